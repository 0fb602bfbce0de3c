"""IMTL-G: the update with equal projections on every unit task gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_square
from ._base import Balancer
from ._boxqp import least_squares
from ._cholesky import cholesky_solve
from ._denoise import SPECTRUM_MAX_RATIO, KeptSpectrum
from ._imtlg_spectrum import (
    ones_in_range,
    pseudo_inverse_from_spectrum,
    shortest_from_spectrum,
)
from ._scaled_cosine import scaled_cosine
from ._solvers import trace_normalized

__all__ = ["IMTLG", "imtlg_weights"]


def imtlg_weights(gramian: Tensor, rtol: float = 1e-12,
                  spectrum: KeptSpectrum | None = None) -> Tensor:
    """Weights ``[K]`` (float64, CPU), summing to 1, with ``g·uₖ`` equal for every task.

    Update rule: ``v = G⁺ d`` with ``dₖ = ‖gₖ‖``, ``w = v / Σv``. Then ``(G w)ₖ = dₖ / Σv``,
    i.e. ``g·(gₖ/‖gₖ‖) = 1/Σv`` for every task ``k`` (Liu et al.'s closed form
    ``α₂:K = g₁Uᵀ(DUᵀ)⁻¹`` when the gradients are independent). Norms decades apart on
    independent directions: ``v = D⁻¹C⁻¹1`` on the cosine matrix (:func:`_scaled`); else
    :func:`_singular`: norms spread beyond ``SPECTRUM_MAX_RATIO`` on a singular cosine
    matrix whose range holds ``1`` (tasks given twice at other norms), the shortest
    solution of ``Gv = d``, from the kept spectrum where the Gramian comes with one
    (``G = DVΛVᵀD``, :func:`~._denoise.cleaned`; :mod:`~._imtlg_spectrum`), else from
    ``C``'s null space (:func:`_spread_singular`); otherwise ``G⁺d`` from the spectrum or
    ``pinv``. When
    ``Σv`` vanishes (``|Σv| ≤ rtol·‖v‖₁``) no such direction exists and the weights are
    zero.

    Example:
        >>> import torch
        >>> from gradbalance.functional import imtlg_weights
        >>> imtlg_weights(torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64)))
        tensor([0.6667, 0.3333], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    gram, scale = trace_normalized(gramian)
    trace = float(scale)
    d = torch.diagonal(gram).clamp_min(0).sqrt()
    v = _scaled(gram)
    if v is None:
        kept = spectrum.scaled(1.0 / trace) if spectrum is not None and trace > 0.0 else None
        v = _singular(gram, d, rtol, kept)
    total = v.sum()
    degenerate = total.abs() <= rtol * v.abs().sum()
    return torch.where(degenerate, torch.zeros_like(v), v / torch.where(degenerate, 1.0, total))


def _scaled(gram: Tensor) -> Tensor | None:
    """``v = G⁻¹d = D⁻¹C⁻¹1`` (``G = DCD``, ``D = diag(d)``, ``C`` the cosine matrix) where
    :func:`~._scaled_cosine.scaled_cosine` gives ``C`` (then ``G`` is invertible and this is
    ``G⁺d``), else None. The pseudo-inverse of ``G`` at ``rtol`` dropped the short rows'
    directions there (projections on the unit task gradients 8 and 67 at 12 decades, where
    they should be equal)."""
    scaled = scaled_cosine(gram)
    if scaled is None:
        return None
    ones = torch.ones(scaled.norms.shape[0], 1, dtype=gram.dtype)
    return cholesky_solve(ones, scaled.factor.L)[:, 0] / scaled.norms


def _singular(gram: Tensor, d: Tensor, rtol: float, spectrum: KeptSpectrum | None) -> Tensor:
    """``G⁺d`` on a cosine matrix :func:`_scaled` does not invert. With the kept spectrum
    (scaled to ``gram``): norms spread beyond ``SPECTRUM_MAX_RATIO`` with ``1`` in its range,
    the shortest solution from it (:func:`~._imtlg_spectrum.shortest_from_spectrum`, tasks
    given twice at norms decades apart); else, unless ``1`` is far outside the range, the
    shortest solution from the cosine matrix's own decomposition (:func:`_spread_singular`);
    then the spectrum's pseudo-inverse (:func:`~._imtlg_spectrum.pseudo_inverse_from_spectrum`),
    then ``pinv``."""
    spread = _norms_spread(d)
    place = None if spectrum is None else ones_in_range(spectrum)
    if spectrum is not None and spread and place:
        return shortest_from_spectrum(spectrum)
    v = _spread_singular(gram, d, rtol) if spread and place is not False else None
    if v is None and spectrum is not None:
        v = pseudo_inverse_from_spectrum(spectrum, d, rtol)
    if v is None:
        v = torch.linalg.pinv(gram, hermitian=True, rtol=rtol) @ d
    return v


def _norms_spread(d: Tensor) -> bool:
    """Whether the norms ``d`` are all positive and spread beyond ``SPECTRUM_MAX_RATIO``."""
    low, high = (float(x) for x in torch.stack(d.aminmax()).tolist())
    return low > 0.0 and high > SPECTRUM_MAX_RATIO * low


#: ``1`` lies in the cosine matrix's range where its part in the cut null space is at most
#: this times ``‖1‖`` (:func:`_spread_singular`).
RANGE_RTOL = 1e-10


def _spread_singular(gram: Tensor, d: Tensor, rtol: float) -> Tensor | None:
    """``G⁺d`` where the rows' norms spread beyond ``SPECTRUM_MAX_RATIO`` and the cosine
    matrix ``C`` is singular with ``1`` in its range (tasks given twice at different norms):
    else None. Then ``Gv = d`` has solutions, ``Dv = s₀ + Nt`` (``s₀ = C⁺1``, ``N`` ``C``'s
    null space), and ``G⁺d`` is the shortest: ``t`` the least-squares solution of
    ``D⁻¹Nt = −D⁻¹s₀`` (condition number the norms' spread, not its square as ``G``'s or
    ``VᵀD²V``'s). The pseudo-inverse of ``G`` itself cut the short rows' directions
    (projections 1.13 apart, relative, where they are equal, at K = 64 over 12 decades).
    ``O(K³)``: one eigen-decomposition of ``C``; the caller checks the spread."""
    cos = gram / torch.outer(d, d)
    lam, vec = torch.linalg.eigh((cos + cos.T) / 2)
    kept = lam > rtol * lam[-1]
    coef = vec.T @ torch.ones_like(d)
    if bool(kept.all()) or float(coef[~kept].norm()) > RANGE_RTOL * d.numel() ** 0.5:
        return None
    s0 = vec[:, kept] @ (coef[kept] / lam[kept])
    null = vec[:, ~kept]
    t = least_squares(null / d[:, None], -(s0 / d)[:, None])
    out: Tensor = (s0 + null @ t[:, 0]) / d
    return out


class IMTLG(Balancer):
    """IMTL-G (Liu et al. 2021): ``g = Σₖ wₖ gₖ``, ``Σ wₖ = 1``, equal ``g·gₖ/‖gₖ‖``.

    Reference: Liu et al., "Towards Impartial Multi-task Learning", ICLR 2021 (IMTL-G), in
    the pseudo-inverse form of Quinton & Rey, arXiv:2406.16232 (dependent gradients too).

    Cost in K: one pseudo-inverse, ``O(K³)``, besides the Gramian ``O(K²P)``.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import IMTLG
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> IMTLG()(g)  # equal projections on both unit gradients
        tensor([0.6667, 0.6667], dtype=torch.float64)
    """

    name = "imtlg"
    inverts_gramian = True
    from_gramian = True
    homogeneous = True
    weight_degree = 0.0  # v = G⁺d scales as c^{-1/2}, and so does Σv

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return imtlg_weights(gramian).to(gramian.device)

    def _rounded_weights(self, gramian: Tensor, losses: Tensor | None, rounding: float,
                         spectrum: KeptSpectrum | None = None) -> Tensor:
        return imtlg_weights(gramian, spectrum=spectrum).to(gramian.device)
