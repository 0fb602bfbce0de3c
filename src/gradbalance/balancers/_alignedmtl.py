"""Aligned-MTL: align the task gradients' principal components, then combine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from .._checks import as_pref, check_choice, check_pref, check_square
from ._base import Balancer
from ._denoise import SPECTRUM_MAX_RATIO, KeptSpectrum
from ._solvers import trace_normalized

__all__ = ["AlignedMTL", "alignedmtl_weights"]

ScaleMode = Literal["min", "median", "rmse"]


def alignedmtl_weights(
    gramian: Tensor, pref: Tensor | None = None, scale_mode: ScaleMode = "min",
    spectrum: KeptSpectrum | None = None,
) -> Tensor:
    """Weights ``[K]`` (float64, CPU): ``w = B p`` with the balance matrix ``B``.

    Update rule: ``G = V Λ Vᵀ`` (eigenvalues above ``λ_max·K·eps``, rank ``r``),
    ``B = √σ · V Λ^{-1/2} Vᵀ`` with ``σ = λ_min`` (``"min"``, the paper), the median or the
    mean (``"rmse"``) of the kept eigenvalues. The aligned gradients ``ĝ = Bᵀ J`` are
    orthogonal with equal norms ``√σ`` (on the span of the gradients); the update is
    ``Σₖ pₖ ĝₖ``, default ``pₖ = 1`` (the authors' code sums them). A Gramian given with its
    kept spectrum (``G = FFᵀ``, ``F = DVΛ^{1/2}`` ``[K, r]``, :func:`~._denoise.cleaned`)
    and norms within ``SPECTRUM_MAX_RATIO``: ``G``'s non-zero eigenpairs from ``FᵀF``
    (``r × r``; ``U = FWΛ^{-1/2}``) instead of a second ``K × K`` eigen-decomposition.

    Example:
        >>> import torch
        >>> from gradbalance.functional import alignedmtl_weights
        >>> alignedmtl_weights(torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64)))
        tensor([1.0000, 0.5000], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    k = gramian.shape[0]
    gram, trace = trace_normalized(gramian)
    p = check_pref("pref", pref, k, 1.0)
    kept = None if spectrum is None or not float(trace) > 0.0 else spectrum.scaled(1.0 / trace)
    # B p = √σ U Λ^{-1/2} Uᵀp: two products with U, never the [K, K] matrix B. From a kept
    # spectrum (G = FFᵀ) U = FWΛ^{-1/2} with FᵀF = WΛWᵀ, so B p = √σ F W Λ^{-3/2} Wᵀ Fᵀ p.
    factor = None
    thin = None if kept is None or kept.norms_within(SPECTRUM_MAX_RATIO) else kept.thin_eigen()
    if kept is not None and kept.norms_within(SPECTRUM_MAX_RATIO):
        factor = kept.factor()
        lam, vec = torch.linalg.eigh(factor.T @ factor)  # r × r: FᵀF = WΛWᵀ
    elif thin is not None:  # norms spread, rank small: G's eigenpairs from F's thin SVD
        lam, vec = thin
    else:
        lam, vec = torch.linalg.eigh(gram)
    tol = lam.max() * k * torch.finfo(torch.float64).eps
    keep = lam > tol
    if not bool(keep.any()):
        return torch.zeros(k, dtype=torch.float64)
    lam, vec = lam[keep], vec[:, keep]
    sigma = lam.min() if scale_mode == "min" else (
        lam.median() if scale_mode == "median" else lam.mean())
    if factor is None:
        weights: Tensor = sigma.sqrt() * (vec @ (lam.rsqrt() * (vec.T @ p)))
    else:
        weights = sigma.sqrt() * (factor @ (vec @ (lam.pow(-1.5) * (vec.T @ (factor.T @ p)))))
    return weights


class AlignedMTL(Balancer):
    """Aligned-MTL (Senushkin et al. 2023): stable, orthogonal, equal-norm aligned gradients.

    Cost in K: one eigendecomposition, ``O(K³)``, besides the Gramian ``O(K²P)``.

    Args:
        pref: task weights ``[K]`` of the aligned gradients (default ones, as the authors'
            code).
        scale_mode: ``"min"`` (paper), ``"median"`` or ``"rmse"`` (mean eigenvalue).

    Reference: Senushkin et al., "Independent Component Alignment for Multi-Task Learning",
    CVPR 2023, Algorithm 1.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import AlignedMTL
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> AlignedMTL()(g)  # each row rescaled to norm √λ_min = 1
        tensor([1., 1.], dtype=torch.float64)
    """

    name = "alignedmtl"
    inverts_gramian = True
    _repr_args = ("num_tasks", "pref", "scale_mode")
    from_gramian = True
    homogeneous = True
    weight_degree = 0.0  # B = √σ V Λ^{-1/2} Vᵀ: √σ and Λ^{-1/2} cancel under G → cG

    def __init__(self, num_tasks: int | None = None, *,
                 pref: Sequence[float] | Tensor | None = None,
                 scale_mode: ScaleMode = "min") -> None:
        super().__init__(num_tasks)
        check_choice("scale_mode", scale_mode, ("min", "median", "rmse"))
        self.pref = as_pref("pref", pref)
        self.scale_mode: ScaleMode = scale_mode

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return alignedmtl_weights(gramian, self.pref, self.scale_mode).to(gramian.device)

    def _rounded_weights(self, gramian: Tensor, losses: Tensor | None, rounding: float,
                         spectrum: KeptSpectrum | None = None) -> Tensor:
        return alignedmtl_weights(gramian, self.pref, self.scale_mode,
                                  spectrum).to(gramian.device)
