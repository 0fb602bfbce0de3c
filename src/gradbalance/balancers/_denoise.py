"""A Gramian without its products' rounding, for the rules that invert it on its range.

Not a balancer module (no ``__all__``). A Gramian multiplied in float32 carries rounding of
about ``1e-7 … 1e-5`` of ``‖gᵢ‖‖gⱼ‖`` in each entry
(:func:`~gradbalance.gramian.products_rounding`; docs/balancers.md, "Numerical range"):
on its cosine matrix ``C = D⁻¹GD⁻¹`` (``D = diag(‖gₖ‖)``) every direction the rows do not
span (tasks that are combinations of others, a task and its reversal ``g``, ``−λg``) shows
an eigenvalue of that size instead of zero. Rules that invert the Gramian on its range
(IMTL-G, Aligned-MTL, Nash-MTL, CAGrad, PCD: ``Balancer.inverts_gramian``) keep such an
eigenvalue at their float64 tolerances and invert the noise: an update as far from the
exact one as the update itself. They read :func:`without_rounding`'s Gramian instead: the
cosine matrix's eigenvalues within the rounding removed; rows multiplied in float64 pass
unchanged. (ConFIG, the cosine matrix's pseudo-inverse, cuts at the same place on its own
eigen-decomposition.)

Example:
    >>> import torch
    >>> g = torch.tensor([[1.0, 0.0], [-0.5, 3e-4]], dtype=torch.float64)  # 1 - |cos| ≈ 4e-8
    >>> cleaned = without_rounding(g @ g.T, 1e-6)
    >>> round(float(torch.linalg.eigvalsh(cleaned)[0]), 12)
    0.0
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._boxqp import CHOLESKY_MAX_COND, ROUNDING_MULTIPLE, SINGLE_LIFT_MAX_NULLITY
from ._cholesky import cholesky_ex

#: The rules that start from a :class:`KeptSpectrum` through ``M = VᵀD²V`` (IMTL-G's
#: ``G'⁺d``, Aligned-MTL's ``FᵀF``) do so where the rows' non-zero norms lie within this
#: ratio (``M``'s condition number at most its square, ``1e6``); else their own
#: decomposition.
SPECTRUM_MAX_RATIO = 1e3
#: :meth:`KeptSpectrum.thin_eigen`: the largest kept rank, as a fraction of the rows, whose
#: thin SVD of the factor costs less than a second ``K × K`` eigen-decomposition of ``G``
#: (rank 8 at K = 1,024: 1 ms against 0.2–0.24 s).
THIN_MAX_FRACTION = 1 / 4
#: :meth:`KeptSpectrum.lift`: the lifted cosine matrix's condition number where the cut
#: allows (a lift below the cut moves the answer less; ``C'``'s null directions are zero to
#: the eigen-decomposition's rounding, about ``K·eps`` of ``λ_max``).
LIFT_COND = 1e8


class KeptSpectrum(NamedTuple):
    """The cleaned Gramian as ``G' = D V Λ Vᵀ D`` (to rounding): the rows' norms ``D``
    ``[K]`` (0 for a zero row), the cosine matrix's kept eigenvectors ``V`` ``[K, r]`` (zero
    on zero rows) and eigenvalues ``Λ`` ``[r]``, all above the ``cut`` (:func:`cleaned`'s, on
    the cosine scale). ``scaled(s)`` is the same for ``s·G'`` (the cosine matrix does not
    change)."""

    norms: Tensor
    vectors: Tensor
    values: Tensor
    cut: float = 0.0

    def scaled(self, s: Tensor | float) -> KeptSpectrum:
        return KeptSpectrum(self.norms * s**0.5, self.vectors, self.values, self.cut)

    def factor(self) -> Tensor:
        """``F = DVΛ^{1/2}`` ``[K, r]``: ``G' = FFᵀ``."""
        return self.vectors * self.norms[:, None] * self.values.sqrt()

    def thin_eigen(self, max_fraction: float = THIN_MAX_FRACTION) -> tuple[Tensor, Tensor] | None:
        """``(λ, U)`` with ``G' = U diag(λ) Uᵀ`` (``U`` ``[K, r]`` orthonormal, ``λ``
        descending) from the thin SVD of the factor ``F = DVΛ^{1/2}`` (``F = U S Wᵀ``,
        ``λ = S²``): ``O(Kr²)``, with no squared condition number (``M = VᵀD²V`` squares the
        norms' spread), where ``r`` is at most ``max_fraction`` of the rows; else None."""
        k, r = self.vectors.shape
        if r == 0 or r > max_fraction * k:
            return None
        u, s, _ = torch.linalg.svd(self.factor(), full_matrices=False)
        return s * s, u

    def norms_within(self, ratio: float) -> bool:
        """Whether the non-zero norms lie within ``ratio`` of one another (then ``VᵀD²V`` has
        condition number at most ``ratio²``; at least one non-zero row)."""
        live = self.norms[self.norms > 0.0]
        return bool(live.numel()) and float(live.max()) <= ratio * float(live.min())

    def lift(self, max_nullity: float = SINGLE_LIFT_MAX_NULLITY) -> float | None:
        """``ε = min(ROUNDING_MULTIPLE·cut, λ_max/LIFT_COND)`` for a single dual QP on
        ``G' + εD²`` (the cosine matrix ``C' + εI``: positive definite, within
        ``1 + ROUNDING_MULTIPLE`` times the cut of the rows' exact one), where few directions
        were cut (at most ``max_nullity`` of the rows: there factorisations of most of the
        ``K`` dimensions cost less than least squares on the factor), no row is zero and
        ``C' + εI`` has condition number below ``CHOLESKY_MAX_COND``; else None. A rule
        taking it solves ``G'`` itself on the lifted answer's support: the lift moves an
        optimum, most where ``G'`` has a vanishing combination (CAGrad's ``g_w = 0``, PCD's
        infeasible constraints)."""
        k = self.norms.shape[0]
        nullity = k - self.values.shape[0]
        if not self.cut > 0.0 or nullity > max_nullity * k or k == nullity:
            return None
        if bool((self.norms == 0.0).any()):
            return None
        top = float(self.values.max())
        lift = min(ROUNDING_MULTIPLE * self.cut, top / LIFT_COND)
        return lift if top + lift < CHOLESKY_MAX_COND * lift else None


class Cleaned(NamedTuple):
    """:func:`cleaned`'s answer: the Gramian without the rounding and, where directions
    were cut, the spectrum that gives it (else None)."""

    gram: Tensor
    spectrum: KeptSpectrum | None


def without_rounding(gram: Tensor, rounding: float) -> Tensor:
    """:func:`cleaned`'s Gramian."""
    return cleaned(gram, rounding).gram


def cleaned(gram: Tensor, rounding: float) -> Cleaned:
    """``G`` with the eigenvalues of its cosine matrix at or below the cut set to zero:
    ``G' = G − D V_c Λ_c V_cᵀ D`` (``C = VΛVᵀ``, ``c`` the eigenvalues at or below ``cut``:
    subtracted, not rebuilt, so the rest of ``G`` keeps its own rounding),
    ``cut = max(rounding, ROUNDING_MULTIPLE·|λ_min|)``
    (a negative ``λ_min`` bounds the rounding: ``‖C − C_exact‖₂ ≥ |λ_min|``, Weyl), and the
    kept part of the spectrum (:class:`KeptSpectrum`: a rule that decomposes ``G'`` again
    can start from it). ``G`` itself (no copy, no spectrum) where ``rounding`` is 0 or
    ``C − rounding·I`` is positive definite (one ``K³/3`` Cholesky factorisation decides: an
    eigen-decomposition only where a direction is cut). Zero rows stay zero. ``G'`` is
    float64 whatever ``G``'s dtype: rounded back to float32 the cut directions would carry
    float32's rounding again (a float32 Gramian through ``compute_weights``).

    Cost: ``O(K³)``; ``G'`` differs from ``G`` by at most the cut times ``‖gᵢ‖‖gⱼ‖``.
    """
    if rounding <= 0.0 or gram.shape[0] == 0:
        return Cleaned(gram, None)
    gram64 = gram.to(torch.float64)
    norms = torch.diagonal(gram64).clamp_min(0.0).sqrt()
    inverse = torch.where(norms > 0.0, norms, torch.inf).reciprocal()  # zero rows: 0
    shifted = gram64 * inverse[:, None] * inverse[None, :]
    live = norms > 0.0
    shifted.diagonal().add_(torch.where(live, -rounding, 1.0))  # a zero row: an identity row
    if int(cholesky_ex(shifted).info) == 0:
        return Cleaned(gram, None)
    every = bool(live.all())  # no zero row: no gathers
    d = norms[live]
    cosine = (gram64 if every else gram64[live][:, live]) / torch.outer(d, d)
    lam, vec = torch.linalg.eigh(0.5 * (cosine + cosine.T))
    cut = max(rounding, ROUNDING_MULTIPLE * max(-float(lam[0]), 0.0))
    dropped = lam <= cut
    v = vec[:, dropped] * d[:, None]
    out = gram64.clone()
    if every:
        out.addmm_(v * lam[dropped], v.T, alpha=-1.0)
        kept = vec[:, ~dropped]
    else:
        index = torch.nonzero(live).flatten()
        out[index[:, None], index[None, :]] -= (v * lam[dropped]) @ v.T
        kept = torch.zeros(norms.shape[0], int((~dropped).sum()), dtype=torch.float64,
                           device=gram.device)
        kept[index] = vec[:, ~dropped]
    return Cleaned(out, KeptSpectrum(norms, kept, lam[~dropped], cut))
