"""GLS: the geometric mean of the task losses (Chennupati et al., 2019)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_nonnegative_losses, check_positive, task_value_vectors
from ._base import LossWeighting, times_weights

__all__ = ["GLS", "gls_weights"]


def gls_weights(losses: Tensor, eps: float = 1e-12) -> Tensor:
    """``wₖ = (Πⱼ Lⱼ)^{1/K} / (K·Lₖ)``: the gradient of the geometric mean, as weights.

    ``∇ (Πⱼ Lⱼ)^{1/K} = Σₖ wₖ ∇Lₖ`` and ``Σₖ wₖ Lₖ = (Πⱼ Lⱼ)^{1/K}``. Losses are clamped at
    ``eps`` (computed in log space, float64).

    Example:
        >>> import torch
        >>> from gradbalance.functional import gls_weights
        >>> gls_weights(torch.tensor([1.0, 4.0]))  # √(1·4) / (2·Lₖ)
        tensor([1.0000, 0.2500], dtype=torch.float64)
    """
    (losses,) = task_value_vectors(("losses", losses))
    check_nonnegative_losses("losses", losses, "gls_weights")
    check_positive("eps", eps)
    logs = losses.clamp_min(eps).log()
    k = losses.shape[0]
    return torch.exp(logs.mean() - logs) / k


class GLS(LossWeighting):
    """Geometric loss strategy: minimise ``(Πₖ Lₖ)^{1/K}``.

    Returns ``wₖ Lₖ`` with the detached weights of :func:`gls_weights` (their sum is the
    geometric mean in value and gradient, for losses at least ``eps``, 1e-12 by default: a loss
    below it is taken as ``eps``); stateless, the losses must be >= 0.

    Reference: Chennupati et al., "MultiNet++: Multi-Stream Feature Aggregation and Geometric
    Loss Strategy for Multi-Task Learning", CVPR Workshops 2019.

    Example:
        >>> import torch
        >>> from gradbalance.weighting import GLS
        >>> GLS(2)(torch.tensor([1.0, 4.0]))  # wₖLₖ = √(1·4) / 2
        tensor([1., 1.])
    """

    name = "gls"
    reads_losses = True
    _weights_state = "_last"
    _last: Tensor

    def __init__(self, num_tasks: int, *, eps: float = 1e-12,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_tasks, device=device)
        self.eps = check_positive("eps", eps)
        self.register_state("_last", torch.full((num_tasks,), 1.0 / num_tasks,
                                                dtype=torch.float64, device=self.device),
                            per_task=True, persistent=False)

    def weights_of(self, losses: Tensor) -> Tensor:
        """The detached weights ``[K]`` (float64) for these losses."""
        return gls_weights(losses, self.eps)

    def _weighted(self, losses: Tensor) -> Tensor:
        check_nonnegative_losses("losses", losses, type(self).__name__)
        w = self.weights_of(losses)
        self._last = w
        return times_weights(w, losses)
