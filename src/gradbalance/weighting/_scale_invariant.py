"""SI: the scale-invariant loss ``Σₖ log Lₖ`` (the baseline of Navon et al. 2022, Nash-MTL)."""

from __future__ import annotations

from torch import Tensor

from ._gls import GLS

__all__ = ["ScaleInvariant", "scale_invariant_weights"]


def scale_invariant_weights(losses: Tensor, eps: float = 1e-12) -> Tensor:
    """``wₖ = 1 / Lₖ``: ``∇ Σₖ log Lₖ = Σₖ wₖ ∇Lₖ``. Losses clamped at ``eps``, float64."""
    return 1.0 / losses.detach().double().clamp_min(eps)


class ScaleInvariant(GLS):
    """Minimise ``Σₖ log Lₖ``: every task's gradient divided by its loss.

    Multiplying a task's loss by a constant leaves the update unchanged (hence the name). The
    returned weighted losses are ``wₖ Lₖ`` with the detached weights ``1/Lₖ``: each equals 1
    in value, and their sum has the gradient of ``Σₖ log Lₖ``. Stateless; losses must be
    >= 0. ``Σₖ log Lₖ = K · log GLS``, so SI is GLS with its weights rescaled by
    ``K / (Πⱼ Lⱼ)^{1/K}``.

    Reference: Navon et al., "Multi-Task Learning as a Bargaining Game", ICML 2022 (the SI
    baseline); Liu et al., "FAMO: Fast Adaptive Multitask Optimization", NeurIPS 2023.
    """

    name = "si"

    def weights_of(self, losses: Tensor) -> Tensor:
        return scale_invariant_weights(losses, self.eps)
