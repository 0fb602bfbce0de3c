"""Many box QPs on one low-rank ``Q``: non-negative least squares in the rank's dimension.

Not a balancer module (no ``__all__``). ``min ½ vᵀQv`` s.t. ``v ≥ lowerᵦ`` depends on ``Q``
only through ``x = Lᵀv`` with ``Q ≈ L Lᵀ``, ``L`` ``[K, r]``. Two factors:

- **exact low rank**: a pivoted Cholesky factor (Higham 2002, *Accuracy and Stability of
  Numerical Algorithms*, §10.3) stopped once every residual diagonal entry is at most
  ``τ = SCHUR_RTOL_PER_ROW · K`` times its own diagonal entry: for a positive semi-definite
  ``Q`` the residual ``Q − LLᵀ`` is too, so each row ``gᵢ`` of a Gramian ``Q = G Gᵀ`` is
  replaced by its projection on the span of ``r`` pivot rows, at a distance of at most
  ``√τ ‖gᵢ‖`` (``√τ ≈ 10⁻⁶`` at ``K = 1,024``);
- **low rank up to rounding**: a Gramian multiplied in float32 is rounded near ``10⁻⁷`` of
  its entries, far above ``τ``, so the pivots stop only where every residual is below
  ``ROUNDED_GATE`` of its diagonal; the factor is then the eigen-factor of the cosine matrix
  cut at ``ROUNDING_MULTIPLE`` times its most negative eigenvalue
  (:func:`~._boxqp.psd_factor`, :func:`~._boxqp.rounding_cut`). The cut moves ``Q`` by at
  most ``ROUNDING_MULTIPLE`` times its distance from the rows' exact Gramian ``Q*``, so
  ``‖Q' − Q*‖₂ ≤ (1 + ROUNDING_MULTIPLE) ε`` with ``ε = ‖Q − Q*‖₂``; for the minimisers
  ``v`` of ``Q'`` and ``v*`` of ``Q*`` on the same convex set, ``‖Jᵀ(v − v*)‖² ≤ vᵀQ*v −
  v*ᵀQ*v* ≤ (1 + ROUNDING_MULTIPLE) ε (‖v‖² + ‖v*‖²)``: the bound of a solve on ``Q``
  itself, ``2ε(‖v‖² + ‖v*‖²)``, times ``1.5``.

With ``v = lower + μ`` each problem is the ``r``-dimensional NNLS ``min_{μ ≥ 0} ‖Lᵀlower +
Lᵀμ‖`` (``K`` columns of length ``r``), solved by Lawson & Hanson (1974, *Solving Least
Squares Problems*, Ch. 23) for all problems in the same tensor operations: one column
enters each open problem per iteration, its passive columns (at most ``r``, independent)
are kept as a list of indices per problem, so a step costs ``O(rK + r³)`` per problem
(the multipliers, one batched factorisation of the ``[m, m]`` passive blocks gathered from
``L``), never ``O(K²)``. The weights need not be unique, the update ``Lᵀv`` is. Before it,
where the rows' conic hull is their span, every problem is certified in ``O(BKr)`` with a
zero update (:mod:`~._zero_cone`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ._active_set import SCHUR_RTOL_PER_ROW, _to_boundary
from ._boxqp import ROUNDING_MULTIPLE, eigen_factor
from ._cholesky import cholesky_ex, cholesky_solve
from ._zero_cone import interior_null, zero_cone_box

#: Fewest tasks for which the low-rank route is tried (below, the dense solve is cheap).
LOW_RANK_MIN_SIZE = 16
#: Largest rank taken by the low-rank route: ``K/4`` (``K/8`` below ``LOW_RANK_WIDE_SIZE``
#: tasks, where the pivots that look for it cost more next to the dense solve); by
#: Lawson–Hanson at most ``√(LOW_RANK_MAX_WORK / K)`` (``r = 64`` at ``K = 256``, ``32`` at
#: ``1,024``), above it by the zero dual cone's certificate alone. Measured at
#: ``K = 256``: rows of rank 48 / 64 0.34 / 0.7–1.5 s against 6 / 12–16 s dense; parallel
#: per-sample blocks of rank 41–64, a third opposed, 1.7–2.3 s against 1.1–1.6 s (many
#: removals): benchmarks/results/many_tasks_cpu.md.
LOW_RANK_MAX_FRACTION = 0.25
LOW_RANK_WIDE_SIZE = 128
LOW_RANK_MAX_WORK = 2**20
#: Fewest tasks for which one problem (DualProj's) tries the zero dual cone's certificate:
#: below, the pivots and the screen cost more than the dense solve of most rows (at K = 64,
#: 3.3 → 6.1 ms a call on conflicting rows, benchmarks/results/many_tasks_cpu.md). From it
#: on at every rank: at K = 1,024 on rows in spans of rank 8 and 32 the certificate takes
#: 0.20–0.23 s and leaves ``‖Jᵀw‖`` at 1e-6 of the mean's norm, where the dense solve
#: (the batched active set, then least squares on a factor) took 0.6–0.7 s for 1e-5 … 1e-4.
ONE_PROBLEM_MIN_SIZE = 256
#: From this many pivots on (at each power of two) the pivots stop where the pace of the
#: residual trace's fall would leave it positive at ``REACH_MARGIN`` times the largest rank.
REACH_FROM = 16
REACH_MARGIN = 2
#: Residual diagonal, relative to ``Qᵢᵢ``, below which the pivots stop and the rank is
#: read from the eigenvalues (a low rank rounded above ``τ``).
ROUNDED_GATE = 1e-4


def _out_of_reach(mass: dict[int, float], r: int, max_rank: int) -> bool:
    """Whether the residual trace after ``r`` pivots (``r`` a power of two from
    ``REACH_FROM``), falling at the pace of the last ``r/2`` pivots, would still be positive
    at ``REACH_MARGIN · max_rank`` pivots: the rank is then taken as out of reach (a cost
    decision only; greedy pivots take the largest residuals first, so the pace only slows)."""
    if r < REACH_FROM or r & (r - 1) or REACH_MARGIN * max_rank <= r:
        return False
    fall = mass[r // 2] - mass[r]
    return fall * (REACH_MARGIN * max_rank - r) < mass[r] * (r // 2)


def _pivots(q: Tensor, max_rank: int, gate: float) -> tuple[Tensor, bool] | None:
    """``(L, exact)``: the pivoted Cholesky factor stopped at ``τ`` (``exact``) or, first,
    where every residual diagonal entry is at most ``gate Qᵢᵢ``; None past ``max_rank`` or
    once the rank looks out of its reach (:func:`_out_of_reach`)."""
    k = q.shape[0]
    resid = torch.diagonal(q).clamp_min(0.0).clone()
    cut, loose = SCHUR_RTOL_PER_ROW * k * resid, gate * resid
    factor = q.new_zeros(k, max_rank)
    mass: dict[int, float] = {}
    for r in range(max_rank + 1):
        pick = resid.argmax()
        flags = torch.stack([resid[pick], (resid > cut).any(), (resid > loose).any(), pick,
                             resid.sum()])
        top, above_cut, above_gate, jf, mass[r] = flags.tolist()  # one host sync per pivot
        j = int(jf)
        if top <= 0.0 or not above_cut:
            return factor[:, :r], True
        if not above_gate:
            return factor[:, :r], False
        if r == max_rank or _out_of_reach(mass, r, max_rank):
            return None
        col = (q[:, j] - factor[:, :r] @ factor[j, :r]) / math.sqrt(top)
        col[resid <= 0.0] = 0.0
        factor[:, r] = col
        resid = (resid - col * col).clamp_min_(0.0)
        resid[j] = 0.0
    return None


def pivoted_cholesky(q: Tensor, max_rank: int) -> Tensor | None:
    """``L`` ``[K, r]`` with ``Q − LLᵀ`` positive semi-definite and each diagonal entry at
    most ``τ Qᵢᵢ`` (module docstring), or None when that needs more than ``max_rank``
    columns. ``O(K r²)``: the rank is revealed before any ``O(K³)`` work."""
    pivoted = _pivots(q, max_rank, 0.0)
    return None if pivoted is None else pivoted[0]


def low_rank_factor(q: Tensor, max_rank: int,
                    screen: Callable[[Tensor], bool] | None = None) -> tuple[Tensor, float] | None:
    """``(L, dependent)``, ``L`` ``[K, r]``, ``r ≤ max_rank``: the exact pivoted factor, else
    the eigen-factor cut at the rounding (module docstring) where the pivots pass
    ``ROUNDED_GATE``; None when neither has rank ``max_rank`` or less, or, before any
    eigen-decomposition, the pivots' factor fails ``screen``. ``dependent``: the
    squared distance from a span, relative to ``‖Lⱼ‖²``, below which a column depends on it:
    ``τ``, or the eigenvalue cut-off (a unit row closer than the dropped rounding)."""
    k = q.shape[0]
    pivoted = _pivots(q, max_rank, ROUNDED_GATE)
    if pivoted is None:
        return None
    factor, exact = pivoted
    if screen is not None and not screen(factor):
        return None
    dependent = SCHUR_RTOL_PER_ROW * k
    if not exact:
        factor, cut = eigen_factor(q, ROUNDING_MULTIPLE)
        dependent = max(dependent, cut)
    return (factor, dependent) if factor.shape[1] <= max_rank else None


class _Open:
    """The open problems: their rows, ``a = Lᵀlower``, and the passive columns in a list per
    problem: ``idx`` ``[B, m]``, ``mu`` (their ``μ > 0``), ``valid`` (the entries in use),
    ``chol`` ``[B, m, m]`` (the Cholesky factor of the block ``L_P L_Pᵀ``, the identity on
    the entries not in use); and ``aside`` ``[B, K]`` (a solve gave the index no positive
    value; cleared on a move)."""

    def __init__(self, factor: Tensor, lower: Tensor) -> None:
        b, k = lower.shape
        self.rows = torch.arange(b)
        self.a = lower @ factor
        self.anorm = self.a.norm(dim=1, keepdim=True)
        self.idx = torch.zeros(b, 0, dtype=torch.int64)
        self.mu = torch.zeros(b, 0, dtype=factor.dtype)
        self.valid = torch.zeros(b, 0, dtype=torch.bool)
        self.chol = torch.zeros(b, 0, 0, dtype=factor.dtype)
        self.aside = torch.zeros(b, k, dtype=torch.bool)

    def keep(self, mask: Tensor) -> None:
        """Only the problems where ``mask`` stay open."""
        for name in ("rows", "a", "anorm", "idx", "mu", "valid", "chol", "aside"):
            setattr(self, name, getattr(self, name)[mask])

    def set_passive(self, idx: Tensor, mu: Tensor, valid: Tensor, chol: Tensor) -> None:
        """The passive lists, the entries in use first (in their order: an entry not in use
        is a row and column of the identity in ``chol``, which leave it triangular), as
        narrow as the longest list."""
        m = int(valid.sum(dim=1).max()) if valid.numel() else 0
        first = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :m]
        self.valid = valid.gather(1, first)
        self.idx = idx.gather(1, first) * self.valid
        self.mu = torch.where(self.valid, mu.gather(1, first), 0.0)
        width = chol.shape[1]
        rows = chol.gather(1, first[..., None].expand(-1, -1, width))
        self.chol = rows.gather(2, first[:, None, :].expand(-1, m, -1))


def _columns(factor: Tensor, idx: Tensor, valid: Tensor) -> Tensor:
    """The passive columns ``L_{idx}`` ``[B, m, r]``, zero on the entries not in use."""
    return factor[idx] * valid[..., None].to(factor.dtype)


def _solve(chol: Tensor, cols: Tensor, a: Tensor, valid: Tensor) -> Tensor:
    """``z`` ``[B, m]`` minimising ``‖a + Σₛ zₛ colsₛ‖`` on the valid entries from the
    factor ``chol`` of ``cols colsᵀ`` (zero elsewhere; NaN rows where it is not finite)."""
    z = cholesky_solve(-(cols @ a[..., None]), chol)[..., 0] * valid.to(a.dtype)
    return z.masked_fill_(~torch.isfinite(z).all(dim=1, keepdim=True), math.nan)


def _factorise(factor: Tensor, a: Tensor, idx: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """``(z, chol)`` on the valid entries: one batched Cholesky factorisation of the
    gathered blocks ``L_P L_Pᵀ`` (the identity elsewhere; NaN rows where it fails)."""
    vf = valid.to(factor.dtype)
    cols = _columns(factor, idx, valid)
    chol, info = cholesky_ex(cols @ cols.mT + torch.diag_embed(1.0 - vf))
    z = _solve(chol, cols, a, valid)
    return z.masked_fill_((info != 0)[:, None], math.nan), chol


def _entering(factor: Tensor, st: _Open, norms: Tensor, tol: float) -> Tensor:
    """Each open problem's entering column, ``−1`` where none: the largest scaled
    multiplier ``wⱼ/‖Lⱼ‖`` (``w = −L x``, ``x = Lᵀv``) above ``tol ‖x‖ ‖Lⱼ‖`` and rounding."""
    x = st.a + (st.mu[..., None] * factor[st.idx]).sum(dim=1)
    w = -(x @ factor.T)
    size = x.norm(dim=1, keepdim=True)
    noise = 8 * SCHUR_RTOL_PER_ROW * (st.anorm + size)
    off = st.aside.clone()
    rows, pos = torch.nonzero(st.valid, as_tuple=True)
    off[rows, st.idx[rows, pos]] = True
    ok = ~off & (norms > 0.0) & (w > torch.maximum(tol * size, noise) * norms)
    score = torch.where(ok, w / torch.where(norms > 0.0, norms, 1.0), -math.inf)
    return torch.where(ok.any(dim=1), score.argmax(dim=1), -1)


def _move(factor: Tensor, a: Tensor, idx: Tensor, mu: Tensor, z: Tensor, valid: Tensor,
          chol: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Lawson–Hanson steps 7–11: ``(μ, valid, chol)`` after moving towards the passive
    solves ``z`` until they are positive (each entry brought to zero leaves, its problem's
    block factorised afresh)."""
    while True:
        moving = (valid & (z <= 0.0)).any(dim=1)
        if not bool(moving.any()):
            return torch.where(valid, z, 0.0), valid, chol
        mm, vm = _to_boundary(mu[moving], z[moving], valid[moving])
        mu[moving], valid[moving] = mm, vm
        zm, chol[moving] = _factorise(factor, a[moving], idx[moving], vm)
        z[moving] = zm.nan_to_num()


def _extend(factor: Tensor, st: _Open, t: Tensor,
            floor: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(chol, cols, pivot_ok)`` with ``t`` appended to each problem's list: the new row of
    the factor ``C⁻¹ L_P Lₜ`` and its diagonal ``√sₜ`` (the left-looking Cholesky step,
    Golub & Van Loan 2013, §4.2), ``sₜ`` the squared distance of ``Lₜ`` from the passive
    span; where ``sₜ`` is at most ``floorₜ`` (dependent), the identity's row instead."""
    m = st.idx.shape[1]
    lt = factor[t]
    cols = torch.cat([_columns(factor, st.idx, st.valid), lt[:, None]], dim=1)
    row = torch.linalg.solve_triangular(st.chol, cols[:, :m] @ lt[..., None],
                                        upper=False)[..., 0]
    schur = (lt * lt).sum(dim=1) - (row * row).sum(dim=1)
    ok = schur > floor[t]
    chol = torch.nn.functional.pad(st.chol, (0, 1, 0, 1))
    chol[:, m, :m] = row * ok[:, None]
    chol[:, m, m] = torch.where(ok, schur, 1.0).sqrt()
    return chol, cols, ok


def _add(factor: Tensor, st: _Open, t: Tensor, floor: Tensor) -> None:
    """``t`` enters each open problem's list; where the solve gives it no positive value
    (or it depends on the passive columns: :func:`_extend`) it is set aside instead, else
    ``μ`` moves towards the passive solves (Lawson–Hanson steps 5–11)."""
    n, m = st.idx.shape
    chol, cols, ok = _extend(factor, st, t, floor)
    idx = torch.cat([st.idx, t[:, None]], dim=1)
    valid = torch.cat([st.valid, ok[:, None]], dim=1)
    mu = torch.cat([st.mu, st.mu.new_zeros(n, 1)], dim=1)
    z = _solve(chol, cols, st.a, valid)
    good = ok & (z[:, -1] > 0.0)  # False on a NaN row
    rows = torch.arange(n)
    st.aside[rows[~good], t[~good]] = True
    valid[:, -1] = good
    chol[~good, m, :m] = 0.0
    chol[~good, m, m] = 1.0
    if bool(good.any()):
        mu[good], valid[good], chol[good] = _move(factor, st.a[good], idx[good], mu[good],
                                                  z[good], valid[good], chol[good])
        st.aside[good] = False
    st.set_passive(idx, mu, valid, chol)


def low_rank_box(factor: Tensor, lower: Tensor, tol: float, max_additions: int,
                 dependent: float | None = None) -> tuple[Tensor, Tensor]:
    """``(v, done)`` ``[B, K]``, ``[B]``: ``argmin ½ vᵀLLᵀv`` s.t. ``v ≥ lowerᵦ`` where done
    (no multiplier above ``tol ‖Lᵀv‖ ‖Lⱼ‖``), ``lower`` elsewhere (open after
    ``max_additions``). Where the rows' conic hull is their span (every projection zero) the
    problems by :func:`~._zero_cone.zero_cone_box`, ``O(BKr)``; the others, or all where it
    finds no certificate, by Lawson–Hanson (:func:`lawson_hanson`)."""
    zero = zero_cone_box(factor, lower, tol)
    if zero is None:
        return lawson_hanson(factor, lower, tol, max_additions, dependent)
    v, done = zero
    rest = ~done
    if bool(rest.any()):
        v[rest], done[rest] = lawson_hanson(factor, lower[rest], tol, max_additions, dependent)
    return v, done


def lawson_hanson(factor: Tensor, lower: Tensor, tol: float, max_additions: int,
                 dependent: float | None = None) -> tuple[Tensor, Tensor]:
    """``(v, done)`` ``[B, K]``, ``[B]``: ``argmin ½ vᵀLLᵀv`` s.t. ``v ≥ lowerᵦ`` where done
    (no multiplier above ``tol ‖Lᵀv‖ ‖Lⱼ‖``), ``lower`` elsewhere (open after
    ``max_additions``), by Lawson–Hanson in ``r`` dimensions (module docstring). A column
    whose squared distance from the passive span is at most ``dependent ‖Lⱼ‖²`` (default
    ``τ``) does not enter."""
    out, done = lower.clone(), torch.zeros(lower.shape[0], dtype=torch.bool)
    norms = factor.norm(dim=1)
    rel = SCHUR_RTOL_PER_ROW * lower.shape[1] if dependent is None else dependent
    st = _Open(factor, lower)
    for _ in range(max_additions + 1):
        t = _entering(factor, st, norms, tol)
        finished = t < 0
        if bool(finished.any()):
            rows = st.rows[finished]
            out[rows] = lower[rows].scatter_add(1, st.idx[finished], st.mu[finished])
            done[rows] = True
            st.keep(~finished)
            t = t[~finished]
        if not st.rows.numel():
            break
        _add(factor, st, t, rel * norms * norms)
    return out, done


def low_rank_projection(q: Tensor, lower: Tensor, tol: float) -> tuple[Tensor, Tensor] | None:
    """``(v, done)``: the box QPs of ``lower`` ``[B, K]`` on ``q`` when ``K ≥
    LOW_RANK_MIN_SIZE`` and ``q`` has a :func:`low_rank_factor` of rank at most ``K/4``
    (``K/8`` below ``LOW_RANK_WIDE_SIZE`` tasks): for two or more problems (UPGrad's) by
    :func:`low_rank_box` up to rank ``√(LOW_RANK_MAX_WORK / K)``; above it, and for one
    problem (DualProj's, from ``ONE_PROBLEM_MIN_SIZE`` tasks), by the zero dual cone's
    certificate alone (:func:`~._zero_cone.zero_cone_box`, ``O(BKr)``; the problems it
    leaves open, or all where it finds none, not done); else None (the caller's dense
    solve)."""
    k = q.shape[0]
    one = lower.shape[0] < 2
    if k < (ONE_PROBLEM_MIN_SIZE if one else LOW_RANK_MIN_SIZE):
        return None
    fraction = LOW_RANK_MAX_FRACTION if k >= LOW_RANK_WIDE_SIZE else LOW_RANK_MAX_FRACTION / 2
    cap = math.isqrt(LOW_RANK_MAX_WORK // k)
    found = low_rank_factor(q, int(fraction * k), _screen(one, cap))
    if found is None:
        return None
    factor, dependent = found
    if not one and factor.shape[1] <= cap:
        return low_rank_box(factor, lower, tol, 3 * factor.shape[1] + 10, dependent)
    return zero_cone_box(factor, lower, tol)


def _screen(one: bool, cap: int) -> Callable[[Tensor], bool]:
    """The test of the pivots' factor before its eigen-factor: where only the zero dual
    cone's certificate would run (one problem, or a rank above ``cap``), whether
    :func:`~._zero_cone.interior_null` finds a null vector on it (a cost decision: the
    certificate is checked on the final factor)."""
    def screen(factor: Tensor) -> bool:
        return not (one or factor.shape[1] > cap) or interior_null(factor) is not None
    return screen
