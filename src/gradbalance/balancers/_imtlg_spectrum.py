"""IMTL-G's ``G⁺d`` from a Gramian's kept spectrum, with no decomposition of its own.

Not a balancer module (no ``__all__``). A cleaned Gramian (:func:`~._denoise.cleaned`) is
``G = DVΛVᵀD``: ``D`` the rows' norms, ``V`` ``[K, r]`` the cosine matrix's kept eigenvectors
(orthonormal), ``Λ`` their eigenvalues. IMTL-G's ``v = G⁺d`` (``d = D1``) then needs only
``O(Kr²)``:

- where ``1`` lies in ``V``'s range (``1 = Va``: tasks given twice, at any norms), ``Gv = d``
  has solutions, ``ΛVᵀDv = a``, and ``G⁺d`` is the shortest: ``v = W(WᵀW)⁻¹Λ⁻¹a`` with
  ``W = DV``, from the QR factorisation of ``W``'s rows sorted by decreasing norm (row-wise
  stable whatever the norms' spread: Cox & Higham 1998, *Stability of Householder QR
  factorization for weighted least squares problems*), condition number the norms' spread,
  not its square (:func:`shortest_from_spectrum`);
- where the norms lie within ``SPECTRUM_MAX_RATIO``: ``G⁺d = DVM⁻¹Λ⁻¹M⁻¹VᵀDd`` with ``M =
  VᵀD²V`` (:func:`pseudo_inverse_from_spectrum`), or from the thin SVD of the factor at a
  small rank.

Whether ``1`` is in the range, far from it or undecided is read from ``‖(I − VVᵀ)1‖``
(:func:`ones_in_range`): the kept eigenvectors of a float32 Gramian differ from the rows'
exact ones by the rounding over the spectrum's gap, about ``1e-7``.

Example:
    >>> import torch
    >>> from gradbalance.balancers._denoise import KeptSpectrum
    >>> v = torch.tensor([[1.0], [1.0]], dtype=torch.float64) / 2**0.5  # two copies
    >>> spectrum = KeptSpectrum(torch.tensor([1.0, 1e4], dtype=torch.float64), v,
    ...                         torch.tensor([2.0], dtype=torch.float64))
    >>> x = shortest_from_spectrum(spectrum)  # G⁺d for G = wwᵀ, w = d = (1, 1e4)
    >>> [round(float(t), 6) for t in x / x.sum()]  # w/Σw: the long copy carries the weight
    [0.0001, 0.9999]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._cholesky import cholesky_ex, cholesky_solve
from ._denoise import SPECTRUM_MAX_RATIO, KeptSpectrum

#: ``1`` lies in the kept spectrum's range where its part off the kept eigenvectors is at
#: most this times ``‖1‖`` (a float32 Gramian's copies: about ``1e-7``), and far outside it
#: above ``OUTSIDE_RANGE_RTOL`` times ``‖1‖`` (rows of a lower rank than the tasks: about
#: ``‖1‖`` itself); between, undecided (the caller's own decomposition decides).
IN_RANGE_RTOL = 1e-5
OUTSIDE_RANGE_RTOL = 1e-4


def ones_in_range(spectrum: KeptSpectrum) -> bool | None:
    """Whether ``1`` lies in the range of the kept spectrum's cosine matrix (True), far
    outside it (False) or neither (None), by ``‖(I − VVᵀ)1‖`` against ``‖1‖``, ``O(Kr)``."""
    vectors = spectrum.vectors
    ones = torch.ones(vectors.shape[0], dtype=vectors.dtype)
    off = float(torch.linalg.vector_norm(ones - vectors @ (vectors.T @ ones)))
    size = math.sqrt(vectors.shape[0])
    if off <= IN_RANGE_RTOL * size:
        return True
    return False if off > OUTSIDE_RANGE_RTOL * size else None


def shortest_from_spectrum(spectrum: KeptSpectrum) -> Tensor:
    """``G⁺d``, ``d = D1``, for ``G = DVΛVᵀD`` with ``1`` in ``V``'s range (every norm
    positive): the shortest ``v`` with ``Gv = d``, ``v = W(WᵀW)⁻¹Λ⁻¹Vᵀ1``, ``W = DV``, by
    the QR factorisation of ``W``'s rows sorted by decreasing norm (module docstring);
    ``1``'s part off the range (``ones_in_range``) is dropped. ``O(Kr²)``."""
    order = torch.argsort(spectrum.norms, descending=True)
    rows = (spectrum.vectors * spectrum.norms[:, None])[order]
    q, r = torch.linalg.qr(rows)
    a = spectrum.vectors.sum(dim=0) / spectrum.values  # Λ⁻¹Vᵀ1
    y = torch.linalg.solve_triangular(r.mT, a[:, None], upper=False)[:, 0]
    return torch.empty_like(spectrum.norms).index_copy_(0, order, q @ y)


def pseudo_inverse_from_spectrum(spectrum: KeptSpectrum, d: Tensor,
                                 rtol: float) -> Tensor | None:
    """``G⁺d`` for ``G = DVΛVᵀD`` (``V`` ``[K, r]`` orthonormal, ``Λ`` positive): with
    ``M = VᵀD²V``, ``G⁺d = DVM⁻¹Λ⁻¹M⁻¹VᵀDd`` (``x = DVy`` in ``G``'s range meets
    ``Gx = P_G d``). ``O(Kr²)`` instead of a second ``O(K³)`` eigen-decomposition (0.25 s at
    K = 1,024). Where the rows' norms spread over more than ``SPECTRUM_MAX_RATIO`` (``M``
    then as ill-conditioned as its square) and the rank is small: ``U diag(λ⁺) Uᵀd`` from the
    thin SVD of the factor (:meth:`~._denoise.KeptSpectrum.thin_eigen`; ``λ`` below ``rtol``
    times the largest dropped, as ``pinv``'s cut); else, or where ``M``'s factorisation
    fails, None."""
    if not spectrum.norms_within(SPECTRUM_MAX_RATIO):
        thin = spectrum.thin_eigen()
        if thin is None:
            return None
        lam, u = thin
        inverse = torch.where(lam > rtol * lam.max(), 1.0 / lam, 0.0)
        return u @ (inverse * (u.T @ d))
    rows = spectrum.vectors * spectrum.norms[:, None]  # DV
    factor = cholesky_ex(rows.T @ rows)
    if int(factor.info) != 0:
        return None
    y = cholesky_solve((rows.T @ d)[:, None], factor.L) / spectrum.values[:, None]
    return rows @ cholesky_solve(y, factor.L)[:, 0]
