"""RLW: Random Loss Weighting (Lin et al., 2022)."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from .._checks import check_choice, check_generator
from ..balancers._random import random_weights
from ..balancers._rng import private_generator
from ._base import LossWeighting, times_weights

__all__ = ["RLW"]

_DISTRIBUTIONS = ("normal", "dirichlet")


class RLW(LossWeighting):
    """Random loss weighting: fresh random weights on the simplex for every optimizer step.

    ``wₖ = softmax(z)ₖ`` with ``z ~ N(0, I)`` drawn from an explicit ``torch.Generator``; one
    draw per step (all micro-batches of a step share it), the next one in :meth:`update`. A
    skipped step keeps its weights and does not advance the generator.

    Args:
        distribution: ``"normal"`` (default) or ``"dirichlet"``.
        generator: a CPU ``torch.Generator`` (its state is saved in :meth:`state_dict`); one
            seeded with ``seed`` is made when omitted.
        seed: seed of the generator made here; default: drawn from torch's global RNG, so
            ``torch.manual_seed`` makes runs repeat.

    Reference: Lin et al., "Reasonable Effectiveness of Random Weighting: A Litmus Test for
    Multi-Task Learning", TMLR 2022.

    Example:
        >>> import torch
        >>> from gradbalance.weighting import RLW
        >>> rlw = RLW(3, seed=0)
        >>> w = rlw.weights
        >>> bool((w > 0).all()), round(w.sum().item(), 12)
        (True, 1.0)
    """

    name = "rlw"
    _weights_state = "_weights"
    _extra_keys = ("num_tasks", "rng_state")
    _rebuilt = (("generator", "_first_generator"),)
    _weights: Tensor

    def __init__(self, num_tasks: int, *, distribution: Literal["normal", "dirichlet"] = "normal",
                 generator: torch.Generator | None = None, seed: int | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_tasks, device=device)
        check_choice("distribution", distribution, _DISTRIBUTIONS)
        self.distribution = distribution
        check_generator("generator", generator)
        if generator is not None and seed is not None:
            raise ValueError("Invalid seed: give either generator or seed, not both")
        if generator is None:
            generator = private_generator() if seed is None else torch.Generator().manual_seed(seed)
        elif generator.device.type != "cpu":
            raise ValueError(f"Invalid generator: on {generator.device} (expected a CPU "
                             f"torch.Generator)")
        self.generator = generator
        self.register_state("_weights", random_weights(num_tasks, self.distribution,
                                                       generator).to(self.device), per_task=True)
        self._initial_rng = generator.get_state()  # after the first draw, the declared default

    def _first_generator(self) -> torch.Generator:
        """The generator back at its state after the draw of the declared ``_weights``."""
        return self.generator.set_state(self._initial_rng)

    def _weighted(self, losses: Tensor) -> Tensor:
        return times_weights(self._weights, losses)

    def _apply_update(self, losses: Tensor, losses_after: Tensor | None) -> None:
        self._weights = random_weights(self.num_tasks, self.distribution,
                                       self.generator).to(self.device)

    def _extra_state(self) -> dict[str, Any]:
        return {**super()._extra_state(), "rng_state": self.generator.get_state()}

    def _check_state(self, tensors: dict[str, Tensor | None], extra: dict[str, Any]) -> None:
        super()._check_state(tensors, extra)
        rng_state = extra.get("rng_state")
        if not isinstance(rng_state, Tensor) or rng_state.dtype != torch.uint8:
            raise ValueError("state_dict lacks 'rng_state' (the uint8 state of a "
                             "torch.Generator); was it saved from another RLW?")
        try:  # torch's own check, on a scratch generator: a bad state never reaches ours
            torch.Generator().set_state(rng_state)
        except (TypeError, RuntimeError) as error:
            raise ValueError(f"state_dict['rng_state'] is not the state of a CPU generator "
                             f"({error}); pass the output of RLW.state_dict()") from None

    def _load_extra(self, extra: dict[str, Any]) -> None:
        super()._load_extra(extra)
        self.generator.set_state(extra["rng_state"].clone())
