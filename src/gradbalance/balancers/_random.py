"""Random: random task weights on the gradients (RLW / RGW)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .._checks import check_choice, check_generator
from ._base import Balancer
from ._rng import OptionalGeneratorState

__all__ = ["Random", "random_weights"]

Distribution = Literal["normal", "uniform", "dirichlet"]
_DISTRIBUTIONS = ("normal", "uniform", "dirichlet")


def random_weights(num_tasks: int, distribution: Distribution = "normal",
                   generator: torch.Generator | None = None,
                   device: torch.device | None = None) -> Tensor:
    """Random weights ``[K]`` (float64) that are positive and sum to 1.

    * ``"normal"`` (the paper's default): ``w = softmax(z)``, ``z ~ N(0, I)``.
    * ``"uniform"``: ``w = softmax(z)``, ``z ~ U(0, 1)ᴷ``.
    * ``"dirichlet"``: ``w ~ Dirichlet(1, …, 1)`` (normalised ``−log U``).

    The draw happens on the generator's device (CPU for the global RNG), then moves to ``device``.

    Example:
        >>> import torch
        >>> from gradbalance.functional import random_weights
        >>> w = random_weights(4, "dirichlet", generator=torch.Generator().manual_seed(0))
        >>> w.shape, bool((w > 0).all()), round(w.sum().item(), 12)
        (torch.Size([4]), True, 1.0)
    """
    check_choice("distribution", distribution, _DISTRIBUTIONS)
    where = generator.device if generator is not None else torch.device("cpu")
    draw = torch.randn if distribution == "normal" else torch.rand
    z = draw(num_tasks, generator=generator, dtype=torch.float64, device=where)
    if distribution == "dirichlet":
        e = -torch.log1p(-z)  # Exp(1); 1 − z > 0 because z < 1
        w = e / e.sum() if bool(e.sum() > 0) else torch.full_like(e, 1.0 / num_tasks)
    else:
        w = torch.softmax(z, dim=0)
    return w if device is None else w.to(device)


class Random(OptionalGeneratorState, Balancer):
    """``g = Σₖ wₖ gₖ`` with fresh random weights every call (positive, summing to 1).

    Update rule (paper's default): ``w = softmax(z)``, ``z ~ N(0, I_K)``.

    Cost in K: ``O(K)`` weights and the sum ``O(KP)``; no Gramian.

    Args:
        distribution: ``"normal"`` (default), ``"uniform"`` or ``"dirichlet"``.
        generator: the random source; None draws from torch's global RNG. A given generator's
            state is saved by :meth:`state_dict` so that a resumed run draws the same weights.

    Reference: Lin et al., "Reasonable Effectiveness of Random Weighting: A Litmus Test for
    Multi-Task Learning", TMLR 2022, arXiv:2111.10603, Algorithm 2.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import Random
        >>> balancer = Random(generator=torch.Generator().manual_seed(0))
        >>> update = balancer(torch.eye(3, dtype=torch.float64))  # the weights themselves
        >>> bool((update > 0).all()), round(update.sum().item(), 12)
        (True, 1.0)
    """

    name = "random"
    _repr_args = ("num_tasks", "distribution")
    from_gramian = True
    homogeneous = True
    weight_degree = 0.0

    def __init__(self, num_tasks: int | None = None, distribution: Distribution = "normal",
                 generator: torch.Generator | None = None) -> None:
        super().__init__(num_tasks)
        check_choice("distribution", distribution, _DISTRIBUTIONS)
        self.distribution: Distribution = distribution
        self.generator = check_generator("generator", generator)

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return random_weights(gramian.shape[0], self.distribution, self.generator,
                              device=gramian.device)
