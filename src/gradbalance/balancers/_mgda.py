"""MGDA: the min-norm point of the convex hull of the (normalised) task gradients."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from .._checks import check_choice, check_square
from ._base import Balancer
from ._solvers import min_norm_simplex, trace_normalized

__all__ = ["MGDA", "mgda_weights"]

Normalization = Literal["none", "l2", "loss", "loss+"]
ApplyTo = Literal["normalized", "raw"]
_NORMALIZATIONS = ("none", "l2", "loss", "loss+")


def _scales(gramian: Tensor, losses: Tensor | None, normalization: str) -> Tensor:
    """Per-task divisors ``cₖ`` of the normalisation ``nₖ = gₖ / cₖ`` (Sener et al.'s code)."""
    k = gramian.shape[0]
    norms = torch.diagonal(gramian).clamp_min(0).sqrt()
    if normalization == "none":
        return torch.ones(k, dtype=torch.float64)
    if normalization == "l2":
        scale = norms
    else:
        assert losses is not None
        loss = losses.to(device="cpu", dtype=torch.float64)
        scale = loss if normalization == "loss" else loss * norms
    if bool((scale <= 0).any()):
        raise ValueError(
            f"MGDA normalization {normalization!r} divides by {scale.tolist()}, which must be "
            f"> 0 (a zero gradient or a non-positive loss); use normalization='none' for this "
            f"step or make the losses positive"
        )
    return scale


def mgda_weights(gramian: Tensor, losses: Tensor | None = None,
                 normalization: Normalization = "none",
                 apply_to: ApplyTo = "normalized") -> Tensor:
    """Weights ``[K]`` (float64, CPU) of MGDA's update ``g = Σₖ wₖ gₖ``.

    Update rule: ``α = argmin_{α∈Δ} ‖Σₖ αₖ nₖ‖²`` with ``nₖ = gₖ / cₖ``. With
    ``apply_to="normalized"`` the update is that min-norm point, ``Σₖ αₖ nₖ`` (weights
    ``αₖ / cₖ``): it has a non-negative inner product with every task gradient. With
    ``apply_to="raw"`` it is ``Σₖ αₖ gₖ`` (Sener et al.'s code, LibMTL): weights ``αₖ``.

    Example:
        >>> import torch
        >>> from gradbalance.functional import mgda_weights
        >>> mgda_weights(torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64)))
        tensor([0.8000, 0.2000], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    gram = gramian.detach().to(device="cpu", dtype=torch.float64)
    scale = _scales(gram, losses, normalization)
    normalized = gram / torch.outer(scale, scale)
    unit, _ = trace_normalized(normalized)
    alpha = min_norm_simplex(unit)
    return alpha / scale if apply_to == "normalized" else alpha


class MGDA(Balancer):
    """MGDA (Sener & Koltun 2018): the min-norm element of the convex hull of the gradients.

    ``α = argmin_{α∈Δ} ‖Σₖ αₖ nₖ‖²`` with the normalised gradients ``nₖ = gₖ / cₖ``:

    * ``"none"``: ``cₖ = 1`` (the paper's algorithm; default);
    * ``"l2"``: ``cₖ = ‖gₖ‖``; ``"loss"``: ``cₖ = Lₖ``; ``"loss+"``: ``cₖ = Lₖ‖gₖ‖``
      (the normalisations of Sener et al.'s code; the loss ones read the losses).

    Cost in K: one simplex QP on the Gramian, ``O(|F|³)`` per pivoting iteration for ``|F|``
    free indices (``O(K³)`` at most), besides the Gramian ``O(K²P)``; from 17 tasks copies of
    a task (rows parallel within the rounding) are collapsed first, ``O(K²)``.

    Args:
        normalization: see above.
        apply_to: ``"normalized"`` (default): the update is the min-norm point of the
            normalised gradients, ``Σ αₖ nₖ``, which keeps MGDA's guarantee (no task's
            gradient has a negative inner product with it). ``"raw"``: ``Σ αₖ gₖ``, the
            weights applied to the raw gradients as in Sener et al.'s code and LibMTL.

    Reference: Sener & Koltun, "Multi-Task Learning as Multi-Objective Optimization",
    NeurIPS 2018, arXiv:1810.04650, eq. 3.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import MGDA
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> MGDA()(g)  # min-norm point of the segment [g₁, g₂]
        tensor([0.8000, 0.4000], dtype=torch.float64)
    """

    name = "mgda"
    _repr_args = ("num_tasks", "normalization", "apply_to")
    from_gramian = True
    homogeneous = True

    def __init__(self, num_tasks: int | None = None, *,
                 normalization: Normalization = "none",
                 apply_to: ApplyTo = "normalized") -> None:
        super().__init__(num_tasks)
        check_choice("normalization", normalization, _NORMALIZATIONS)
        check_choice("apply_to", apply_to, ("normalized", "raw"))
        self.normalization: Normalization = normalization
        self.apply_to: ApplyTo = apply_to
        # Instance values of the class flags: they depend on the settings.
        self.needs_losses = normalization in ("loss", "loss+")
        self.homogeneous = not (normalization in ("l2", "loss+") and apply_to == "normalized")

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        w = mgda_weights(gramian, losses, self.normalization, self.apply_to)
        return w.to(gramian.device)
