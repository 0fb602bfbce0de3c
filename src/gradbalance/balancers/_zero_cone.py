"""Many box QPs on one low-rank ``Q`` whose rows' conic hull is their whole span.

Not a balancer module (no ``__all__``). On a factor ``L`` ``[K, r]`` of full column rank
(``Q = L Lᵀ``, :func:`~._low_rank.low_rank_factor`), ``min ½ vᵀQv`` s.t. ``v ≥ lower`` is the
projection of ``a = Lᵀlower`` onto the cone ``{y : Ly ≥ 0}`` (``x = Lᵀv``, the dual-cone
projection of Quinton & Rey 2024, Prop. 1, in the rank's coordinates). Where some ``c > 0``
has ``Lᵀc = 0`` that cone is ``{0}``: ``Ly ≥ 0`` and ``cᵀLy = 0`` give ``Ly = 0``, so
``y = 0``. Every projection is then zero and every ``v ≥ lower`` with ``Lᵀv = 0`` is a
minimiser: no direction improves every task, the update is ``0``. Rows drawn at random in an
``r``-dimensional span have such a ``c`` once ``K`` is well above ``2r`` (Wendel 1962: ``K``
random directions in ``ℝʳ`` lie in no half-space with probability ``1 − 2^{1−K} Σ_{i<r}
C(K−1, i)``).

One search finds ``c`` (:func:`interior_null`): alternating projections between ``{c ≥ 1}``
and the null space of ``Lᵀ``, then, for the dense paths, ``c = argmin ‖Lᵀc‖`` s.t. ``c ≥ 1``
exactly (one NNLS in ``r`` dimensions). Then, for all ``B`` problems in the same
tensor operations, ``δ = −L(LᵀL)⁻¹a`` (``Lᵀδ = −a``, from the QR factorisation of ``L``),
``t = maxⱼ (−δⱼ/cⱼ)⁺`` and ``v = lower + δ + t c ≥ lower``: ``O(BKr)`` in all, against the
``r`` additions of a batched Lawson–Hanson. An answer is kept only where ``x = Lᵀv``
passes the stop of :func:`~._low_rank.low_rank_box` itself, complementarity included
(:func:`passes_stop`); the others stay open for Lawson–Hanson.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ._active_set import SCHUR_RTOL_PER_ROW
from ._precond import sparse_product

#: Most alternating projections :func:`interior_null` makes before giving up.
NULL_ROUNDS = 16
#: Most rounds where a dense solve would follow instead (:mod:`._boxqp`, a rank up to
#: ``K/2``): the intersection narrows as ``K/r`` nears 2 (at K = 256 and 1,024, rank
#: ``0.3–0.45 K`` took 64–1,024 rounds; 1,024 rounds at K = 1,024, rank 480: 0.2 s).
DENSE_NULL_ROUNDS = 1024
#: Least entry, relative to the largest, of a null vector taken as positive (above the
#: rounding of its projection).
NULL_MARGIN = 1e-8
#: :func:`interior_null` reads the projections' least entry ``m`` (relative to the largest)
#: every ``NULL_WINDOW`` rounds and stops once the rate of the last two windows, ``ρ =
#: mₜ/mₜ₋₂``, would not bring ``|m|`` below ``NULL_NEAR`` (where the crossing to a positive
#: vector comes within a few rounds) inside its budget: ``2·NULL_WINDOW·ln(NULL_NEAR/|m|)/ln ρ``
#: more rounds, or ``ρ ≥ 1`` (no intersection: ``m`` settles at the sets' gap).
NULL_WINDOW = 32
NULL_NEAR = 3e-3

#: Rounds :func:`interior_null` goes on after its first positive ``c``, keeping the one whose
#: least entry is the largest against its largest. The first is positive by a hair (least
#: over largest ``1e-8 … 1e-3``), and a certificate ``v = lower + δ + tc`` grows as that
#: ratio shrinks: its update on the rows carries what the factor's cut left out, multiplied
#: by ``v``'s size (float32 rows of rank ``K/2``, K = 200, ``P = K/2``: ``c``'s largest over
#: least ``3.7e7``, ``v`` ``8e8`` times its problem, updates 30 times the rows' mean norm where
#: the exact one is about ``1e-6`` of it). The rounds after it move ``c`` into the
#: intersection: ``3.7e7 → 1.2e4`` after one, ``2.3e2`` after 64 (rank ``3K/8``, K = 256:
#: ``2.9e3 → 64``). ``O(Kr)`` each.
INWARD_ROUNDS = 64
#: Least entry, relative to the largest, of a certificate kept after the inward rounds.
#: ``v`` grows as its inverse, and with it what the rounding of a float32 Gramian leaves in
#: the null space the certificate was found in: 1,024 sparse rows (2 % of 400 coordinates,
#: rank 400, eigenvalues 0.13 and up) gave DualProj a positive null vector at ``1.2e-8``
#: from the exact search, weights to ``2e5`` and an update 816 times its mean's size where
#: the exact projection (on the float64 Gramian) is 0.12 of it; Gaussian rows of rank
#: ``3K/8`` (K = 256, 1,024) give certificates at ``0.016`` and ``0.034``.
CERTIFICATE_MIN_RATIO = 1e-4
#: ``(A, b) → y``: ``argmin_{y ≥ 0} ‖A y − b‖`` (``A`` ``[r, K]``), an exact NNLS solver
#: (:func:`~._boxqp.nnls`).
LeastSquares = Callable[[Tensor, Tensor], Tensor]


def passes_stop(factor: Tensor, lower: Tensor, v: Tensor, tol: float,
                a: Tensor | None = None) -> Tensor:
    """``[B]``: the KKT conditions of :func:`~._low_rank.low_rank_box`'s stop at ``v``:
    ``v ≥ lower``, no multiplier ``wⱼ = −Lⱼ·x`` (``x = Lᵀv``) above ``max(tol ‖x‖, ν) ‖Lⱼ‖``
    and ``|wⱼ| ≤ ν ‖Lⱼ‖`` wherever ``vⱼ > lowerⱼ`` (complementarity to the rounding ``ν =
    8τ(‖Lᵀlower‖ + ‖x‖ + Σ|vⱼ|‖Lⱼ‖)``: ``x`` is a sum of the terms ``vⱼLⱼ``, rounded to
    their sizes, and the certificate's ``v = lower + δ + t c`` can be far larger than
    ``lower`` where the rows' conic hull barely covers their span: rank ``3K/8`` at
    K = 1,024, ``c`` up to 1.7e4, ``‖x‖`` 5e-11 of ``‖Lᵀlower‖``); False where not finite.
    Where ``‖x‖ ≤ ν`` every ``|wⱼ| ≤ ‖Lⱼ‖‖x‖`` (Cauchy–Schwarz) meets both multiplier
    tests, and ``w`` is formed only for the other problems (one ``[B, r] × [r, K]`` product
    fewer for a certificate: UPGrad at K = 1,024, rank ``K/2``, 94 → 35 ms). ``a``:
    ``lower·L`` where the caller has it."""
    x = v @ factor
    size = x.norm(dim=1, keepdim=True)
    a = sparse_product(lower, factor) if a is None else a
    anorm = a.norm(dim=1, keepdim=True)
    norms = factor.norm(dim=1)
    terms = (v.abs() @ norms)[:, None]
    nu = 8 * SCHUR_RTOL_PER_ROW * lower.shape[1] * (anorm + size + terms)  # [B, 1]
    stop = (v >= lower).all(dim=1) & torch.isfinite(v).all(dim=1)
    loose = torch.nonzero(stop & (size > nu).flatten()).flatten()
    if loose.numel():
        noise = nu[loose] * norms
        w = -(x[loose] @ factor.T)
        feasible = w <= torch.maximum(tol * size[loose] * norms, noise)
        complementary = (w.abs() <= noise) | (v[loose] <= lower[loose])
        stop[loose] = (feasible & complementary).all(dim=1)
    return stop


def interior_null(factor: Tensor, rounds: int = NULL_ROUNDS,
                  exact: LeastSquares | None = None,
                  basis: Tensor | None = None) -> Tensor | None:
    """``c`` ``[K]`` with ``c ≥ 1`` and ``Lᵀc = 0`` up to rounding, or None: alternating
    projections (von Neumann 1950) between ``{c ≥ 1}`` and the null space of ``Uᵀ``
    (``U = D⁻¹L`` the unit rows, zero rows left out), from ``1``, each ``O(Kr)``, until the
    projection on the null space is positive; ``c = D⁻¹c'`` scaled to a least entry of 1.
    Where the intersection is thin (``K/r`` near 2) they stall: at K = 1,024, rank 512,
    16,384 rounds found none. With ``exact``, after ``rounds``: ``c = 1 + y``, ``y`` the
    exact ``argmin_{y ≥ 0} ‖Uᵀ(1 + y)‖`` (one NNLS of ``K`` columns in ``r`` dimensions,
    0.3 s there), projected on the null space. A heuristic either way (None where neither
    finds one): the certificate is what :func:`passes_stop` checks. ``basis``: orthonormal
    columns spanning ``L``'s range where the caller has them, for rows of balanced norms
    and none zero (:func:`~._boxqp._shares_eigenvectors`): the projections run on ``L``'s
    rows as they are (``c`` itself, not ``D⁻¹c'``), with no QR factorisation."""
    norms = factor.norm(dim=1)
    if basis is None:
        live = torch.nonzero(norms > 0.0).flatten()
        units = factor[live] / norms[live, None]
        basis = torch.linalg.qr(units)[0]
    else:
        live, units, norms = torch.arange(factor.shape[0]), basis, torch.ones_like(norms)
    y = basis.new_ones(live.numel())
    least: list[float] = []  # the least entry every NULL_WINDOW rounds
    for done in range(rounds):
        c = y - basis @ (basis.T @ y)
        found, low = _positive(c, factor, norms, live)
        if found is not None:
            return _inward(c, found, low, basis, factor, norms, live)
        if done % NULL_WINDOW == 0:
            least.append(low)
            if _out_of_reach(least, rounds - done):
                break
        y = c.clamp_min(1.0)
    if exact is None:
        return None
    ones = basis.new_ones(live.numel())
    c = ones + exact(units.T.contiguous(), -(units.T @ ones))
    c = c - basis @ (basis.T @ c)
    found, low = _positive(c, factor, norms, live)
    return None if found is None else _inward(c, found, low, basis, factor, norms, live)


def _inward(c: Tensor, found: Tensor, low: float, basis: Tensor, factor: Tensor,
            norms: Tensor, live: Tensor) -> Tensor | None:
    """The certificate after ``INWARD_ROUNDS`` more alternating projections from the first
    positive null vector ``c`` (``found``, ``low``: :func:`_positive`'s), the one whose least
    entry is the largest against its largest; None where that ratio stays below
    ``CERTIFICATE_MIN_RATIO``."""
    best = (found, low)
    for _ in range(INWARD_ROUNDS):
        y = c.clamp_min(1.0)
        c = y - basis @ (basis.T @ y)
        again, ratio = _positive(c, factor, norms, live)
        if again is not None and ratio > best[1]:
            best = again, ratio
    return best[0] if best[1] >= CERTIFICATE_MIN_RATIO else None


def _out_of_reach(least: list[float], left: int) -> bool:
    """Whether :func:`interior_null`'s rounds stop: the least entries ``least`` (negative,
    every ``NULL_WINDOW`` rounds, relative to the largest) have not shrunk over the last two
    windows, or at that rate would not reach ``NULL_NEAR`` in the ``left`` rounds.

    Alternating projections approach a thin intersection at a rate that keeps falling: at
    K = 1,024, rank ``K/2``, the least entry went −0.17, −0.14, −0.13, −0.12 at rounds 32 …
    128 and was −0.08 after 1,024 (none found; the exact search then took 0.26 s, the rounds
    0.3 s before it); rank ``7K/16`` crossed at round 423 after −0.08, −0.05, −0.02 at 64,
    128, 256."""
    if len(least) < 3:
        return False
    now, before = least[-1], least[-3]
    if not (now < 0.0 and before < 0.0):
        return False
    rate = now / before
    if rate >= 1.0:
        return True
    needed = 2 * NULL_WINDOW * math.log(NULL_NEAR / -now) / math.log(rate)
    return needed > left


def _positive(c: Tensor, factor: Tensor, norms: Tensor,
              live: Tensor) -> tuple[Tensor | None, float]:
    """``(D⁻¹c, m)``: ``D⁻¹c`` on the rows ``live`` (1 on the zero rows) scaled to a least
    entry of 1, where every entry of the null vector ``c`` is above ``NULL_MARGIN`` of the
    largest, else None; ``m`` its least entry relative to the largest (one host sync)."""
    low, high = torch.stack(c.aminmax()).tolist()
    relative = low / high if high > 0.0 else -1.0
    if not low > NULL_MARGIN * high:
        return None, relative
    out = factor.new_ones(factor.shape[0])
    out[live] = c / norms[live]
    return out / out.min(), relative


def zero_cone_box(factor: Tensor, lower: Tensor, tol: float, rounds: int = NULL_ROUNDS,
                  exact: LeastSquares | None = None,
                  basis: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """``(v, done)`` ``[B, K]``, ``[B]``: ``v = lower + δ + t c`` (module docstring) where it
    passes :func:`passes_stop`, ``lower`` elsewhere; None where :func:`interior_null` finds
    no ``c`` in ``rounds`` (then by ``exact``, where given). ``O(BKr + Kr²)``, and ``O(Kr)``
    per round. ``basis``: orthonormal columns spanning ``L``'s range on balanced rows (the
    eigenvectors ``L`` was made of, :func:`~._boxqp._top_factor`): no QR factorisation,
    here or in :func:`interior_null` (K = 1,024, rank ``K/2``: two of 38 ms)."""
    c = interior_null(factor, rounds, exact, basis)
    if c is None:
        return None
    a = sparse_product(lower, factor)  # UPGrad's bounds: a row of L each, no product
    if basis is None:
        basis, tri = torch.linalg.qr(factor)
        delta = -(basis @ torch.linalg.solve_triangular(tri.mT, a.T, upper=False)).T
    else:  # δ = −lower·UUᵀ: balanced rows (on rows of norms 1e-3 … 1e3 it misses the stop)
        delta = -(sparse_product(lower, basis) @ basis.T)
    t = (-delta / c).amax(dim=1, keepdim=True).clamp_min(0.0)
    v = lower + (delta + t * c).clamp_min(0.0)
    done = passes_stop(factor, lower, v, tol, a)
    return torch.where(done[:, None], v, lower), done
