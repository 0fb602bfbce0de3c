"""Many box QPs on one positive semi-definite ``Q`` at once: Lawson–Hanson's active set.

Not a balancer module (no ``__all__``). ``min ½ vᵀQv`` s.t. ``v ≥ lowerᵦ`` for ``B`` rows
``lowerᵦ`` (UPGrad's K projections), where ``Q`` is singular or badly conditioned. With
``Q = L Lᵀ`` this is the non-negative least-squares problem ``min ‖Lᵀ(lower + y)‖``,
``y ≥ 0``, and Lawson & Hanson's method (1974, *Solving Least Squares Problems*, Ch. 23)
needs ``L`` only through ``Q``: its passive-set solves are ``Q_PP z = −(Q lower)_P`` and its
dual vector is ``−(Qv)``. Every problem takes its steps in the same tensor operations
(masks, not Python lists): one index enters each open problem's passive set per iteration
(from ``BLOCK_MIN_SIZE`` tasks, up to ``BLOCK_SIZE`` together where that step stays positive),
the passive blocks' factors are kept and extended (:class:`~._passive_factor.PassiveFactor`),
and the passive sets stay independent (an entering column whose Schur complement is
rounding, as the factor of :func:`~._boxqp.psd_factor` would drop it, stays out). A problem
still open after its additions is left to the caller.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._cholesky import cholesky_ex, cholesky_solve, principal_block
from ._passive_factor import Block, PassiveFactor

_EPS = torch.finfo(torch.float64).eps
#: Smallest Schur complement of an entering column, relative to its diagonal entry and per
#: row of ``Q``: the eigenvalue cut-off of :func:`~._boxqp.psd_factor`.
SCHUR_RTOL_PER_ROW = 4 * _EPS
#: Up to this many tasks the free-set solves factorise the whole masked ``Q`` (the identity
#: on the fixed indices: the same factor, in fewer operations than gathering the blocks).
MASKED_MAX_SIZE = 16
#: From this many free indices on, :func:`free_blocks` gathers each problem's block by its
#: rows, then their columns (:func:`~._cholesky.principal_block`) instead of one ``[B, m,
#: m]`` index: one thread, 1.7× faster for 256 blocks of 64 of 256, 1.3× for 1,024 of 64 of
#: 1,024, 8× at 600 of 1,024; slower for 32 (18 against 6 ms for 1,024 blocks).
PER_PROBLEM_MIN_SIZE = 64
#: Indices entering together per iteration where each problem's best ``BLOCK_SIZE``
#: candidates give a positive solve (from ``BLOCK_MIN_SIZE`` tasks, one problem too): the
#: passive factors are read once per block, not once per index (:func:`_add_block`). One
#: problem had one index per iteration: DualProj on one row the negated sum of the others
#: (K = 256) took 255 iterations, 0.18 s (9.3–10× the Gramian; 2.9× by blocks), CAGrad's
#: projection with a zero row at K = 1,024 0.21–0.25 s (86–121 ms by blocks).
BLOCK_SIZE = 8
BLOCK_MIN_SIZE = 64
#: Most numbers the passive factors of one batch of problems may hold (float64: 1 GiB).
FACTOR_MAX_ENTRIES = 2**27


def free_first(free: Tensor) -> tuple[Tensor, Tensor]:
    """``(idx, valid)`` ``[B, m]`` (``m``: the largest free set): each row's free indices
    first, in order, then its fixed ones; ``valid`` marks the free entries."""
    counts = free.sum(dim=1)
    m = int(counts.max())
    idx = torch.argsort((~free).to(torch.int8), dim=1, stable=True)[:, :m]
    return idx, torch.arange(m)[None, :] < counts[:, None]


def free_blocks(q: Tensor, idx: Tensor, valid: Tensor) -> Tensor:
    """The blocks ``Q[idx, idx]`` ``[B, m, m]``, the identity on the invalid entries: one
    gather of ``[B, m, m]`` flat indices, or from ``PER_PROBLEM_MIN_SIZE`` on two gathers per
    problem (its rows, then their columns)."""
    b, m = idx.shape
    if m >= PER_PROBLEM_MIN_SIZE:
        block = q.new_empty(b, m, m)
        for out, at in zip(block.unbind(0), idx.unbind(0), strict=True):
            principal_block(q, at, out)
    else:
        block = q.reshape(-1)[(idx * q.shape[0])[:, :, None] + idx[:, None, :]]
    block.masked_fill_(~(valid[:, :, None] & valid[:, None, :]), 0.0)
    block.diagonal(dim1=1, dim2=2).add_((~valid).to(q.dtype))
    return block


def solve_free(q: Tensor, rhs: Tensor, free: Tensor, total: Tensor | None) -> Tensor:
    """``y`` ``[B, K]`` with ``Q_FF y_F = rhs_F`` (``+ ν1`` and ``1ᵀy_F = total`` if given).

    Zero on the fixed indices; one batched Cholesky factorisation of the ``[B, m, m]`` free
    blocks (of the masked ``[B, K, K]`` up to ``MASKED_MAX_SIZE`` tasks). A problem whose
    block does not factorise gets a NaN row.
    """
    if q.shape[0] <= MASKED_MAX_SIZE:
        vf = free.to(q.dtype)
        z, info = _solve_block(q * (vf[:, :, None] * vf[:, None, :]) + torch.diag_embed(1.0 - vf),
                               rhs * vf, vf, total)
        return z.masked_fill_(((info != 0) | ~torch.isfinite(z).all(dim=1))[:, None], math.nan)
    y = torch.zeros_like(rhs)
    if not bool(free.any()):
        return y
    idx, valid = free_first(free)
    vf = valid.to(q.dtype)
    z, info = _solve_block(free_blocks(q, idx, valid), rhs.gather(1, idx) * vf, vf, total)
    y.scatter_(1, idx, z)
    y[(info != 0) | ~torch.isfinite(z).all(dim=1)] = math.nan
    return y


def _solve_block(block: Tensor, r: Tensor, vf: Tensor,
                 total: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(z, info)``: ``block z = r`` on the entries ``vf`` marks (``+ ν·vf`` and
    ``vfᵀz = total`` if given), zero elsewhere; ``info`` the factorisation's."""
    chol, info = cholesky_ex(block)
    if total is not None:
        sol = cholesky_solve(torch.stack([r, vf], dim=-1), chol)
        nu = (total - sol[..., 0].sum(dim=1)) / sol[..., 1].sum(dim=1).clamp_min(1e-300)
        return (sol[..., 0] + nu[:, None] * sol[..., 1]) * vf, info
    return cholesky_solve(r[..., None], chol)[..., 0] * vf, info


def _product(y: Tensor, q: Tensor) -> Tensor:
    """``y Q`` for a sparse ``y`` ``[B, K]`` (its few passive entries)."""
    out: Tensor = torch.sparse.mm(y.to_sparse(), q)
    return out


class _Problems:
    """The open problems' state: ``y ≥ 0`` and ``yQ`` ``[B, K]``, the passive sets and their
    factors (:class:`~._passive_factor.PassiveFactor`), the indices set aside (a solve gave
    them no positive value; cleared when ``y`` moves) and the additions made."""

    def __init__(self, q: Tensor, lower: Tensor) -> None:
        b, k = lower.shape
        self.lower, self.shift = lower, lower @ q
        self.rows = torch.arange(b)
        self.y = torch.zeros(b, k, dtype=q.dtype)
        self.yq = torch.zeros(b, k, dtype=q.dtype)
        self.passive = torch.zeros(b, k, dtype=torch.bool)
        self.aside = torch.zeros(b, k, dtype=torch.bool)
        self.additions = torch.zeros(b, dtype=torch.int64)
        self.factor = PassiveFactor(q, -self.shift)

    def keep(self, mask: Tensor) -> None:
        """Only the problems where ``mask`` stay open."""
        if bool(mask.all()):
            return
        for name in ("lower", "shift", "rows", "y", "yq", "passive", "aside", "additions"):
            setattr(self, name, getattr(self, name)[mask])
        self.factor.keep(mask)


def _entering(st: _Problems, d: Tensor, indep_min: Tensor, tol: float,
              width: int = 1) -> tuple[Tensor, Tensor]:
    """``(t, valid)`` ``[B, width]``: the indices that may enter each open problem's passive
    set, best first, ``valid`` where one does: the largest ``gⱼ = −wⱼ/√sⱼ`` (``w = Qv``,
    ``sⱼ`` the column's squared distance from the passive span, kept by the factors) among
    the independent columns (``sⱼ`` above ``indep_min``: ``4·eps·K·Qⱼⱼ``) whose ``−wⱼ``
    exceeds ``tol ‖x‖ √sⱼ`` (``‖x‖² = vᵀQv``) and its own rounding, ``8 eps √Qⱼⱼ Σᵢ √Qᵢᵢ
    |vᵢ|`` (was ``8 eps √Qⱼⱼ maxᵢ √Qᵢᵢ Σᵢ |vᵢ|``: with norms 1e-6 … 1e6 and large weights on
    the shortest rows, above violations of cosine 1e-4 that the projections then kept)."""
    neg_w = -(st.yq + st.shift)
    v = st.lower + st.y
    size = (v * neg_w).sum(dim=1).neg_().clamp_min_(0.0).sqrt_()
    noise = (8 * _EPS) * (v.abs() @ d)  # |(Qv)ⱼ|'s rounding ≤ eps √Qⱼⱼ Σᵢ √Qᵢᵢ |vᵢ|
    off = st.factor.off
    indep = off > indep_min
    root = torch.where(indep, off, 1.0).sqrt_()
    ok = indep & ~(st.passive | st.aside)
    ok &= neg_w > torch.maximum(tol * size[:, None] * root, noise[:, None] * d)
    score = torch.where(ok, neg_w / root, -math.inf)
    if width == 1:
        best = score.argmax(dim=1, keepdim=True)
        return best, ok.any(dim=1, keepdim=True)
    top, best = score.topk(width, dim=1)
    return best, top > -math.inf


def _to_boundary(y: Tensor, z: Tensor, passive: Tensor) -> tuple[Tensor, Tensor]:
    """Lawson–Hanson steps 8–11 for each row: the largest step from ``y`` towards ``z`` that
    keeps ``y ≥ 0``; the indices it brings to zero leave the passive set."""
    neg = passive & (z <= 0.0)
    ratio = torch.where(neg, y / torch.where(neg, y - z, 1.0), math.inf)
    alpha = ratio.min(dim=1, keepdim=True).values.clamp(0.0, 1.0)
    blocking = neg & (ratio <= alpha)
    y = torch.where(blocking, 0.0, y + alpha * (z - y))
    passive = passive & ~blocking & (y > 0.0)
    return torch.where(passive, y, 0.0), passive


def _inner(st: _Problems, sel: Tensor, z: Tensor) -> None:
    """Lawson–Hanson steps 7–11 for the problems ``sel``: move towards ``z`` until the
    passive solve is positive (each index brought to zero leaves, its problem's factor is
    recomputed)."""
    y, passive = st.y[sel], st.passive[sel]
    while True:
        moving = (passive & (z <= 0.0)).any(dim=1)
        if not bool(moving.any()):
            break
        ym, pm = _to_boundary(y[moving], z[moving], passive[moving])
        y[moving], passive[moving] = ym, pm
        st.factor.remove(sel[moving], pm)
        z[moving] = st.factor.solve(sel[moving]).nan_to_num()
    st.y[sel] = y = torch.where(passive, z, 0.0)
    st.passive[sel] = passive
    st.yq[sel] = _product(y, st.factor.q)


def box_active_set(q: Tensor, lower: Tensor, tol: float, max_additions: int,
                   dependent: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(v, done)`` ``[B, K]``, ``[B]``: :func:`_box_active_set` on chunks of at most
    ``FACTOR_MAX_ENTRIES / K²`` problems (their factors hold up to ``K²`` numbers each)."""
    b, k = lower.shape
    step = max(1, FACTOR_MAX_ENTRIES // (k * k))
    if b <= step:
        return _box_active_set(q, lower, tol, max_additions, dependent)
    parts = [_box_active_set(q, lower[i: i + step], tol, max_additions, dependent)
             for i in range(0, b, step)]
    return torch.cat([v for v, _ in parts]), torch.cat([d for _, d in parts])


def _box_active_set(q: Tensor, lower: Tensor, tol: float, max_additions: int,
                    dependent: float = 0.0) -> tuple[Tensor, Tensor]:
    """``(v, done)`` ``[B, K]``, ``[B]``: ``argmin ½ vᵀQv`` s.t. ``v ≥ lowerᵦ`` where done.

    Lawson–Hanson from ``v = lower``: each iteration the index of the largest scaled
    multiplier enters each open problem (:func:`_entering`), the passive system is solved,
    and ``y`` moves towards it (:func:`_inner`). A problem is done when no multiplier
    exceeds ``tol ‖x‖ √Qⱼⱼ`` (Lawson–Hanson's test on the factor, ``‖x‖ = ‖Lᵀv‖``), and left
    open after ``max_additions`` additions. An entering column whose Schur complement is at
    most ``max(SCHUR_RTOL_PER_ROW·K, dependent)`` times its diagonal entry stays out
    (``dependent``: a rounding ``Q`` carries beyond float64's, :func:`~._boxqp.resolved_box`).
    """
    b, k = lower.shape
    diag = torch.diagonal(q).clamp_min(0.0)
    d, indep_min = diag.sqrt(), max(SCHUR_RTOL_PER_ROW * k, dependent) * diag
    width = min(BLOCK_SIZE, k) if k >= BLOCK_MIN_SIZE else 1
    out, done = lower.clone(), torch.zeros(b, dtype=torch.bool)
    st = _Problems(q, lower)
    while st.rows.numel():
        cand, valid = _entering(st, d, indep_min, tol, width)
        finished = ~valid[:, 0]
        if bool(finished.any()):
            out[st.rows[finished]] = st.lower[finished] + st.y[finished]
            done[st.rows[finished]] = True
        live = ~finished & (st.additions < max_additions)
        cand, valid = cand[live], valid[live]
        st.keep(live)
        if not st.rows.numel():
            break
        st.additions += 1
        single = _add_block(st, cand, valid, indep_min) if width > 1 else st.rows.new_ones(
            st.rows.shape[0], dtype=torch.bool)
        sel = torch.nonzero(single).flatten()
        if sel.numel():
            t = cand[sel, 0]
            _add(st, sel, t, indep_min[t])
    return out, done


def _add_block(st: _Problems, cand: Tensor, valid: Tensor, indep_min: Tensor) -> Tensor:
    """The problems with ``width`` candidates take the longest prefix of them (at least 2)
    whose solve on the enlarged passive set is positive on every index: a Lawson–Hanson step
    to that set's minimiser with no move back (the objective falls, as by single additions;
    Bro & De Jong 1997, *A fast non-negativity-constrained least squares algorithm*).
    Returns the mask of the others (one addition each, :func:`_add`)."""
    rest = ~valid.all(dim=1)
    sel = torch.nonzero(~rest).flatten()
    if not sel.numel():
        return rest
    t = cand[sel]
    z, ok, block = st.factor.try_block(sel, t, indep_min[t])
    n, b = t.shape
    passive = st.passive[sel, None].repeat(1, b, 1)  # [n, j, K]: P and the first j + 1
    ar = torch.arange(b)
    passive.scatter_(2, t[:, None].expand(-1, b, -1), (ar[None, None, :] <= ar[None, :, None])
                     .expand(n, -1, -1))
    pos = ok & ((z > 0.0) | ~passive).all(dim=2)
    size = torch.where(pos, ar + 1, 0).amax(dim=1)
    good = size >= 2
    if bool(good.any()):
        take, rows = sel[good], torch.nonzero(good).flatten()
        st.factor.add_block(take, size[good], Block(*(part[good] for part in block)))
        st.passive[take] = passive[rows, size[good] - 1]
        st.y[take] = y = torch.where(st.passive[take], z[rows, size[good] - 1], 0.0)
        st.yq[take] = _product(y, st.factor.q)
        st.aside[take] = False
    rest[sel[~good]] = True
    return rest


def _add(st: _Problems, sel: Tensor, t: Tensor, min_schur: Tensor) -> None:
    """``t`` enters each open problem ``sel``; where the solve gives it no positive value (or
    it depends on the passive set: ``sₜ`` not above ``min_schur``) it is set aside instead,
    else ``y`` moves (:func:`_inner`)."""
    z, root, h_t = st.factor.try_add(t, min_schur, sel)
    rows = torch.arange(t.shape[0])
    good = torch.isfinite(z).all(dim=1) & (z[rows, t] > 0.0)
    st.aside[sel[~good], t[~good]] = True
    if not bool(good.any()):
        return
    take = sel[good]
    st.factor.add(take, t[good], root[good], h_t[good])
    st.passive[take, t[good]] = True
    _inner(st, take, z[good])
    st.aside[take] = False
