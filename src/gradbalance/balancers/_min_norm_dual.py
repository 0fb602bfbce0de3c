"""MGDA's min-norm point through its dual box QP on the cosine matrix: certified, or lifted.

Not a balancer module (no ``__all__``). MGDA's ``argmin_{w ∈ Δ} wᵀGw`` is, with ``u = Dw``
(``D = diag(G)^{1/2}``), ``min uᵀCu`` over ``u ≥ 0``, ``aᵀu = 1`` on the cosine matrix ``C``
(``aᵢ = 1/dᵢ``). On a positive definite ``C`` its dual is a box QP (:func:`min_norm_dual`),
which block principal pivoting solves with a few factorisations of its free block.

A Gramian of rows of which a few are combinations of others (a task whose loss is a sum of
others', rows in a span of rank a little below ``K``) is singular, and, multiplied in
float32, has negative eigenvalues of its rounding's size. There :func:`lifted_min_norm`
solves the dual on ``C + εI`` with ``ε = ROUNDING_MULTIPLE·|λ_min(C)|`` (the lift of
:func:`~._boxqp.rounding_lift`, which UPGrad's projections take too): ``C`` is at least
``|λ_min|`` from every positive semi-definite matrix (Weyl), the rows' exact cosine matrix
``C*`` among them, so ``‖C + εI − C*‖₂ ≤ (1 + ROUNDING_MULTIPLE)‖C − C*‖₂``, the bound of the
least-squares route's eigenvalue cut (:func:`~._boxqp.rounding_cut`), and the value
``uᵀCu`` at the answer is within ``ε‖u‖²`` of the minimum on ``C``. It is taken only where
the rounding's null space is small (:data:`~._boxqp.SINGLE_LIFT_MAX_NULLITY`) and the lifted
matrix well conditioned (``(λ_max + ε)/|λ_min|`` below
:data:`~._boxqp.CHOLESKY_MAX_COND`); the least squares on the eigen-factor (an interior
point and Lawson–Hanson, ``O(K³)`` per Newton step) elsewhere. One thread, conflicting rows
with ``K/16`` of them sums of two others, the solve alone: ``K = 256`` 33 → 8 ms,
``K = 1,024`` 775 → 230 ms, the same update (cosine 1 − 1e-15, norms within 2e-11);
MGDA's ``combine`` over the Gramian 3.1× → 1.7× and 5.1× → 2.6× (docs/balancers.md).

Example:
    >>> import torch
    >>> from gradbalance.balancers._boxqp import cosine_spectrum
    >>> f64 = torch.float64
    >>> g = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0), dtype=f64)
    >>> g[-4:] = g[:4] + g[4:8]  # four tasks that are sums of two others
    >>> null = torch.zeros(64, dtype=f64)
    >>> null[[0, 4, 60]] = torch.tensor([1.0, 1.0, -1.0], dtype=f64)  # g₀ + g₄ − g₆₀ = 0
    >>> gram = g @ g.T - 1e-4 * torch.outer(null, null)  # a float32 product's rounding
    >>> spectrum = cosine_spectrum(gram)  # λ_min < 0 (how a float32 product rounds varies)
    >>> w = lifted_min_norm(spectrum, 1e-12)
    >>> float(spectrum.lam[0]) < 0, round(float(w.sum()), 12), bool((w >= 0).all())
    (True, 1.0, True)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._boxqp import (
    CHOLESKY_MAX_COND,
    SINGLE_LIFT_MAX_NULLITY,
    CosineSpectrum,
    rounding_lift,
    solve_box_qp_batched,
)
from ._precond import shifted


def min_norm_dual(cos: Tensor, a: Tensor, tol: float) -> Tensor:
    """``argmin uᵀCu`` over ``u ≥ 0``, ``aᵀu = 1`` (up to a positive factor) for a positive
    definite ``C`` (trace-normalised, condition number below ``CHOLESKY_MAX_COND``) by its
    dual box QP.

    Independent rows leave ``0`` outside their hull, and the min-norm point is
    ``x* = z/‖z‖²`` for the least-distance point ``z = argmin ‖z‖`` s.t. ``gᵢᵀz ≥ 1``
    (Lawson & Hanson 1974, Ch. 23: ``g_wᵀz ≥ 1`` on the hull, so ``‖g_w‖ ≥ 1/‖z‖``). Its
    dual is ``min_{λ ≥ 0} ½ λᵀGλ − 1ᵀλ`` with ``z = Σ λᵢgᵢ``; ``s = Dλ`` makes it the box
    QP ``min_{s ≥ 0} ½ sᵀCs − aᵀs`` on the well-conditioned ``C``: block principal
    pivoting (:func:`~._boxqp.solve_box_qp_batched`, what it leaves open by least squares on
    a factor of ``C``). Complementarity ``λᵢ(gᵢᵀz − 1) = 0`` gives ``Σλ = ‖z‖²``, so
    ``λ/Σλ`` is the minimiser ``w`` and ``s ∝ Dw = u``.
    """
    k = cos.shape[0]
    zeros = torch.zeros(1, k, dtype=torch.float64)
    return solve_box_qp_batched(cos, (-a / k)[None], zeros, tol=tol, well_conditioned=True)[0]


def lifted_min_norm(spectrum: CosineSpectrum, tol: float) -> Tensor | None:
    """MGDA's weights ``w`` (``Σw = 1``) on the lifted cosine matrix ``C + εI`` of a singular
    Gramian (:mod:`~._min_norm_dual`; ``spectrum``: its :func:`~._boxqp.cosine_spectrum`),
    or None where the lift does not apply: a zero row (the min-norm point is 0 there), no
    negative eigenvalue, a large rounding null space, or a lifted condition number above
    ``CHOLESKY_MAX_COND`` (float64 rows: a lift at float64's rounding)."""
    got = lifted_cosine(spectrum)
    if got is None:
        return None
    lifted, lift = got
    norms = spectrum.norms
    lifted.div_(norms.shape[0] * (1.0 + lift))  # trace 1, as the dual's
    u = min_norm_dual(lifted, norms.min() / norms, tol)
    weights = u / norms
    return weights / weights.sum()


def lifted_cosine(spectrum: CosineSpectrum) -> tuple[Tensor, float] | None:
    """``(C + εI, ε)`` for the single dual QPs of MGDA, PCD and CAGrad (``C`` the cosine
    matrix of ``spectrum``, ``ε`` its :func:`single_lift`), or None where the lift does not
    apply: a zero row (left out of ``C``), or :func:`single_lift` refuses."""
    if spectrum.lam.shape[0] != spectrum.norms.shape[0] or spectrum.lam.shape[0] == 0:
        return None
    lift = single_lift(spectrum.lam)
    return None if lift is None else (shifted(spectrum.cosine, lift), lift)


def single_lift(lam: Tensor) -> float | None:
    """The lift of a single dual QP (MGDA's, PCD's) on a cosine matrix with the ascending
    eigenvalues ``lam``: :func:`~._boxqp.rounding_lift` up to ``SINGLE_LIFT_MAX_NULLITY``,
    where the lifted matrix's condition number ``(λ_max + ε)/(λ_min + ε)`` is below
    ``CHOLESKY_MAX_COND``; else None (also for float64 rows, whose rounding is at float64's
    resolution)."""
    low, high = lam[[0, -1]].tolist()  # one host sync
    lift = rounding_lift(lam, low, SINGLE_LIFT_MAX_NULLITY, high)
    if lift is None or not high + lift < CHOLESKY_MAX_COND * (low + lift):
        return None
    return lift
