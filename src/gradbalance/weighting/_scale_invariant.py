"""SI: the scale-invariant loss ``Σₖ log Lₖ`` (the baseline of Navon et al. 2022, Nash-MTL)."""

from __future__ import annotations

from torch import Tensor

from .._checks import check_nonnegative_losses, check_positive, task_value_vectors
from ._gls import GLS

__all__ = ["ScaleInvariant", "scale_invariant_weights"]


def scale_invariant_weights(losses: Tensor, eps: float = 1e-12) -> Tensor:
    """``wₖ = 1 / Lₖ``: ``∇ Σₖ log Lₖ = Σₖ wₖ ∇Lₖ``. Losses clamped at ``eps``, float64.

    Example:
        >>> import torch
        >>> from gradbalance.functional import scale_invariant_weights
        >>> scale_invariant_weights(torch.tensor([2.0, 4.0]))
        tensor([0.5000, 0.2500], dtype=torch.float64)
    """
    (losses,) = task_value_vectors(("losses", losses))
    check_nonnegative_losses("losses", losses, "scale_invariant_weights")
    check_positive("eps", eps)
    return 1.0 / losses.clamp_min(eps)


class ScaleInvariant(GLS):
    """Minimise ``Σₖ log Lₖ``: every task's gradient divided by its loss.

    A constant factor on a task's loss leaves the update unchanged. The returned weighted
    losses are ``wₖ Lₖ`` with the detached ``wₖ = 1/max(Lₖ, eps)`` (each equals 1 in value for
    a loss of at least ``eps``, 1e-12 by default). Losses
    must be >= 0.

    Reference: Navon et al., "Multi-Task Learning as a Bargaining Game", ICML 2022 (the SI
    baseline); Liu et al., "FAMO: Fast Adaptive Multitask Optimization", NeurIPS 2023.

    Example:
        >>> import torch
        >>> from gradbalance.weighting import ScaleInvariant
        >>> ScaleInvariant(2)(torch.tensor([2.0, 4.0]))  # Lₖ / Lₖ, gradient ∇ log Lₖ
        tensor([1., 1.])
    """

    name = "si"

    def weights_of(self, losses: Tensor) -> Tensor:
        return scale_invariant_weights(losses, self.eps)
