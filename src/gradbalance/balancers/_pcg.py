"""Conjugate-gradient solves on the free sets of many box QPs sharing one ``Q``.

Not a balancer module (no ``__all__``). The pivoting of :mod:`._boxqp` on ``B`` problems
(UPGrad's K projections) needs ``Q_FF y_F = rhs_F`` for a different free set ``F`` per
problem; here all of them take their conjugate-gradient steps together, two
``[B, K] × [K, K]`` products per step (:func:`pcg_free`; the preconditioner in
:mod:`._precond`). :func:`rough_free_sets` runs the
same block pivoting in float32 (half the cost of a product), each problem pivoting as soon
as its own solve is done, from a start two pivots in (:func:`opposite_start`): a guess of
each problem's free set and solution, which the float64 pivoting then only confirms (one
tight solve and the optimality test) or corrects.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ._precond import (
    Preconditioner,
    SetupCache,
    either,
    row_dot,
    sparse_count,
    sparse_product,
)
from ._projected import Plan, projected_start

_norm = torch.linalg.vector_norm  # the direct kernel: Tensor.norm dispatches in Python first

#: Step cap of one solve.
CG_MAX_STEPS = 100
#: :func:`pcg_free` drops the rows whose solve is done from its tensors once they are this
#: fraction of the rows it holds; until then they stay, parked (zero residual and direction):
#: a gather of every tensor costs more than the products of a few rows.
PARK_FRACTION = 1 / 8
#: Relative residual of the float32 solves of :func:`rough_free_sets` (looser for the first
#: one and after a pivot that moved more than ``ROUGH_FAR_MOVES`` indices: their free sets
#: are still far from the optimum) and their step cap, the fraction of a row's largest
#: ``|y|`` (or ``|w|``) below which a sign there is not trusted, and its pivoting iterations.
ROUGH_RTOL = 1e-6
ROUGH_FIRST_RTOL = 1e-4
ROUGH_FAR_MOVES = 8
ROUGH_MAX_STEPS = 20
ROUGH_MARGIN = 1e-5
ROUGH_MAX_PIVOTS = 8
#: The rows whose solve is done pivot together once they hold this many entries (or all
#: the open rows are done): a pivot's tensor operations cost as much as a step's product
#: of ``[8, 1024] × [1024, 1024]``; until then they take more steps.
ROUGH_PIVOT_ENTRIES = 8192


def restricted_product(q: Tensor, y0: Tensor, y0q: Tensor, f: Tensor,
                       kept: Tensor | None = None) -> Tensor:
    """``(y0 ∘ f) Q`` from ``y0 Q``: the product of the few entries ``f`` drops is subtracted
    (:func:`sparse_product`; one product of ``y0 ∘ f`` instead when they are many);
    ``kept``: ``y0 ∘ f`` where the caller has it."""
    kept = y0 * f if kept is None else kept
    dropped = y0 - kept
    nonzeros = sparse_count(dropped, q.shape[1])
    if nonzeros is None:
        return kept @ q
    if nonzeros == 0:
        return y0q.clone()
    return y0q - sparse_product(dropped, q, nonzeros)


#: ``(rows, f) → W``: a preconditioner's setup of the problems ``rows`` on free sets ``f``.
Setup = Callable[[Tensor, Tensor], "Tensor | None"]


def _as_preconditioner(h: Tensor | Preconditioner) -> Preconditioner:
    """``h`` as a :class:`~._precond.Preconditioner` (a tensor: plain ``(h)_FF``)."""
    return h if isinstance(h, Preconditioner) else Preconditioner.plain(h)


def pcg_free(q: Tensor, h: Tensor | Preconditioner, rhs: Tensor, free: Tensor, y0: Tensor,
             y0q: Tensor, rtol: Tensor, max_steps: int = CG_MAX_STEPS,
             setup: Setup | None = None, atol: Tensor | None = None,
             rtol_min: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, converged, yQ)`` (``[B, K]``, ``[B]``, ``[B, K]``): ``Q_FF y_F = rhs_F`` per row,
    ``y`` zero off ``F``; ``y0q = y0 Q`` (the last solve's product).

    Conjugate gradients preconditioned by ``(Q⁻¹)_FF`` (``h ≈ Q⁻¹``, possibly in a lower
    precision), or by a :class:`~._precond.Preconditioner` (one more product per free set),
    from ``y0``: two ``[B, K] × [K, K]`` products per step for all the problems
    together, until the residual is ``rtol`` ``[B]`` times ``‖rhs_F‖`` (with ``atol`` ``[B]``:
    ``atol`` within ``[rtol_min, rtol]`` times ``‖rhs_F‖``), at most
    ``max_steps`` steps, in the dtype of ``q``. ``yQ`` is carried along the iterations from
    ``y0q`` (the unmasked operator products), so neither the start nor the caller's
    multipliers need a product of their own. ``setup(rows, f)``: the preconditioner's
    :meth:`~._precond.Preconditioner.setup` of the rows ``rows`` (a :class:`SetupCache`'s).
    """
    f = free.to(q.dtype)
    y = y0 * f
    yq = restricted_product(q, y0, y0q, f, y)
    r = rhs * f
    target = _target(_norm(r, dim=1), rtol, atol, rtol_min)
    r.addcmul_(yq, f, value=-1.0)
    converged = _norm(r, dim=1) <= target
    live = torch.arange(y.shape[0])
    active = ~converged  # rows of ``live`` not parked
    parked = int(converged.sum())
    x, xq = y, yq  # every row held: updated in place, no gather
    if parked >= PARK_FRACTION * y.shape[0]:  # the rows still iterating, gathered
        live = torch.nonzero(active).flatten()
        f, r, target, x, xq = (t.index_select(0, live) for t in (f, r, target, y, yq))
        active, parked = torch.ones_like(live, dtype=torch.bool), 0
    elif parked:  # parked: a zero residual leaves them where they are
        r.index_fill_(0, torch.nonzero(converged).flatten(), 0.0)
    pre = _as_preconditioner(h)
    u = pre.setup(f) if setup is None else setup(live, f)
    z = pre.apply(r, f, u)
    p, rz = z, row_dot(r, z)
    for _ in range(max_steps):
        if live.numel() == 0:
            break
        pq = p @ q
        pap = row_dot(p, pq)  # p is zero off F: pᵀQ_FF p
        alpha = torch.where(pap > 0, rz / torch.where(pap > 0, pap, 1.0), 0.0)[:, None]
        x.addcmul_(alpha, p)
        xq.addcmul_(alpha, pq)
        r.addcmul_(pq.mul_(f), alpha, value=-1.0)
        ok = _norm(r, dim=1) <= target
        stop = (ok | (pap <= 0)) & active  # converged, or broken down (left unconverged)
        if bool(stop.any()):
            done = live[stop]
            y[done], yq[done], converged[done] = x[stop], xq[stop], ok[stop]
            active &= ~stop
            parked += int(stop.sum())
            if parked >= PARK_FRACTION * live.numel():
                keep = torch.nonzero(active).flatten()
                live, f, r, target, x, xq, p, rz, active = (
                    t.index_select(0, keep)
                    for t in (live, f, r, target, x, xq, p, rz, active))
                u = None if u is None else u.index_select(0, keep)
                parked = 0
            else:  # parked: a zero residual and direction leave x where it is
                idx = torch.nonzero(stop).flatten()
                r.index_fill_(0, idx, 0.0)
                p.index_fill_(0, idx, 0.0)
        z = pre.apply(r, f, u)
        rz_new = row_dot(r, z)
        p = z.addcmul_(p, torch.where(rz > 0, rz_new / torch.where(rz > 0, rz, 1.0), 0.0)[:, None])
        rz = rz_new
    if x is not y:  # else updated in place
        y[live], yq[live] = x, xq
    return y, converged, yq


def _target(size: Tensor, rtol: Tensor, atol: Tensor | None, rtol_min: float) -> Tensor:
    """The residual at which a solve of right-hand side norm ``size`` stops: ``rtol·size``, or
    ``atol`` within ``[rtol_min, rtol]`` times ``size``."""
    if atol is None:
        return rtol * size
    return torch.minimum(torch.maximum(atol, rtol_min * size), rtol * size)


def opposite_start(h: Tensor, shift: Tensor, free0: Tensor,
                   whole: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(free, y, yQ)`` ``[B, K]``: a start of the pivoting from the all-free side, where
    ``free0`` is empty (a cold start) and the first pivot from there drops one index.

    Every index free: ``y = −Q⁻¹ shift`` (``h = Q⁻¹``, one product; ``whole`` where the
    caller knows it: ``−lower`` for ``shift = Q·lower``, no product); its one negative index
    ``a`` leaves, which a rank-one update of ``Q⁻¹`` solves in closed form,
    ``y' = y − h_a y_a / h_aa`` (``y'Q = −shift − e_a y_a / h_aa``), and the next pivot
    keeps the indices where ``y' > 0``: two pivoting iterations without a solve (UPGrad's
    projections, ``shift = p_i Q_i``: ``y = −p_i e_i``, ``a = i``). Elsewhere ``free0`` and
    ``y = 0``."""
    y = -(shift @ h) if whole is None else whole.to(h.dtype)
    neg = y < -ROUGH_MARGIN * y.abs().amax(dim=1, keepdim=True)
    cold = (neg.sum(dim=1) == 1) & ~free0.any(dim=1)
    a = neg.to(torch.uint8).argmax(dim=1)
    step = y.gather(1, a[:, None]) / torch.diagonal(h)[a, None]
    y = (y - step * h[a]).scatter_(1, a[:, None], 0.0)
    yq = (-shift).scatter_add(1, a[:, None], -step)
    keep = cold[:, None]
    return torch.where(keep, y > 0.0, free0), y * keep, yq * keep


@dataclass
class _Live:
    """The open problems of :func:`rough_free_sets`, compacted together: their index
    ``rows``, free sets ``f`` (as 0/1), point ``y``, product ``yq = yQ``, residual ``r``,
    its target, search direction ``p``, ``rz = rᵀz``, steps since the last pivot, pivots,
    best count of infeasible indices and iterations without a better one; ``u``, the
    preconditioner's per free set (:meth:`~._precond.Preconditioner.setup`), or None."""

    rows: Tensor
    f: Tensor
    y: Tensor
    yq: Tensor
    r: Tensor
    target: Tensor
    p: Tensor
    rz: Tensor
    steps: Tensor
    pivots: Tensor
    best: Tensor
    stale: Tensor
    u: Tensor | None = None

    def take(self, keep: Tensor) -> None:
        """Only the rows ``keep`` (a mask) stay."""
        idx = torch.nonzero(keep).flatten()  # once: a mask would be searched per field
        for field in fields(self):
            value = getattr(self, field.name)
            if value is not None:
                setattr(self, field.name, value.index_select(0, idx))


def _restart(live: _Live, q: Tensor, rhs: Tensor, free: Tensor, at: Tensor,
             cache: SetupCache, moves: Tensor | None = None) -> None:
    """The rows ``at`` (a mask) start a new solve on ``free`` (theirs; ``moves``: how many
    indices the pivot moved, None for a first solve): ``y`` zero off it, ``yQ`` updated
    (:func:`restricted_product`), the residual, its target and the preconditioner's ``u``
    recomputed."""
    idx = torch.nonzero(at).flatten()  # row gathers by index: a mask is searched per use
    f = free.to(q.dtype)
    y = live.y.index_select(0, idx)
    kept = y * f
    yq = restricted_product(q, y, live.yq.index_select(0, idx), f, kept)
    rows = live.rows.index_select(0, idx)
    b = rhs.index_select(0, rows)
    live.f.index_copy_(0, idx, f)
    live.y.index_copy_(0, idx, kept)
    live.yq.index_copy_(0, idx, yq)
    live.r.index_copy_(0, idx, (b - yq).mul_(f))
    loose = torch.ones_like(idx, dtype=torch.bool) if moves is None else moves > ROUGH_FAR_MOVES
    rtol = torch.where(loose, ROUGH_FIRST_RTOL, ROUGH_RTOL)
    live.target[idx] = rtol * _norm(b.mul_(f), dim=1)
    live.steps[idx] = 0
    u = cache.setup(rows, f)
    if u is not None:
        if live.u is None:
            live.u = u.new_zeros((live.r.shape[0], *u.shape[1:]))
        live.u.index_copy_(0, idx, u)


def _step(live: _Live, q: Tensor, pre: Preconditioner, fresh: Tensor) -> Tensor:
    """One conjugate-gradient step of every open row (``fresh``: a new solve, ``p = z``);
    the rows whose solve is done (converged, broken down or out of steps)."""
    z = pre.apply(live.r, live.f, live.u)
    rz = row_dot(live.r, z)
    old = torch.where(fresh | (live.rz <= 0), 0.0, live.rz)
    beta = torch.where(old > 0, rz / torch.where(old > 0, old, 1.0), 0.0)
    live.p = z.addcmul_(live.p, beta[:, None])  # z + βp: one pass
    live.rz = rz
    pq = live.p @ q
    pap = row_dot(live.p, pq)
    alpha = torch.where(pap > 0, rz / torch.where(pap > 0, pap, 1.0), 0.0)[:, None]
    live.y.addcmul_(alpha, live.p)
    live.yq.addcmul_(alpha, pq)
    live.r.addcmul_(pq.mul_(live.f), alpha, value=-1.0)
    live.steps += 1
    done: Tensor = (_norm(live.r, dim=1) <= live.target) | (pap <= 0)
    return done | (live.steps >= ROUGH_MAX_STEPS)


def _pivot(live: _Live, due: Tensor, rhs: Tensor, out_free: Tensor,
           out_y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The pivoting decision of the rows ``due``, whose result so far is written out:
    ``(stop, free, moves)``, the rows that stop (no infeasible index, no better count for two
    iterations, or out of pivots), the next free sets (of the rows ``due``) and how many
    indices each moves."""
    idx = torch.nonzero(due).flatten()
    rows = live.rows.index_select(0, idx)
    y, f = live.y.index_select(0, idx), live.f.index_select(0, idx) > 0
    w = live.yq.index_select(0, idx).sub_(rhs.index_select(0, rows))
    bad = either(f, y < -ROUGH_MARGIN * y.abs().amax(dim=1, keepdim=True),
                 w < -ROUGH_MARGIN * w.abs().amax(dim=1, keepdim=True))
    count = bad.sum(dim=1)
    out_free.index_copy_(0, rows, f)
    out_y.index_copy_(0, rows, y)
    better = count < live.best[due]
    live.best[due] = torch.minimum(count, live.best[due])
    live.stale[due] = torch.where(better, 0, live.stale[due] + 1)
    live.pivots[due] += 1
    stop = (count == 0) | (live.stale[due] >= 2) | (live.pivots[due] >= ROUGH_MAX_PIVOTS)
    return stop, f ^ bad, count


def rough_free_sets(q: Tensor, h: Tensor | Preconditioner, shift: Tensor,
                    free0: Tensor, whole: Tensor | None = None,
                    cache: SetupCache | None = None,
                    start: Plan | None = None) -> tuple[Tensor, Tensor]:
    """``(free, y)`` ``[B, K]`` (float64): a guess of each box problem's optimal free set and
    ``y`` (``w = Qy + shift ≥ 0``, ``y ≥ 0``, ``yᵀw = 0``), from the free sets ``free0``
    (where empty: from :func:`opposite_start`, with ``whole``, the all-free solution
    ``−Q⁻¹ shift`` where known).

    Block principal pivoting (Júdice & Pires 1994) in float32 with the conjugate-gradient
    steps of :func:`pcg_free` (``h``: ``Q⁻¹`` or a preconditioner holding it, which
    :func:`opposite_start` uses), each problem pivoting as soon as its own solve is done (its
    residual ``ROUGH_RTOL`` times ``‖rhs_F‖``, ``ROUGH_FIRST_RTOL`` the first time and
    after a pivot that moved more than ``ROUGH_FAR_MOVES`` indices, a breakdown, or
    ``ROUGH_MAX_STEPS``) and starting its next solve in the same batch: every
    index whose ``y`` or ``w`` is below ``−ROUGH_MARGIN`` times the row's largest ``|y|`` or
    ``|w|`` changes side; a problem stops when none does, when their number has not fallen
    for two iterations, or after ``ROUGH_MAX_PIVOTS``; a free index whose ``y`` is not
    positive leaves, and a problem whose float32 solve overflowed keeps ``free0`` (and
    ``y = 0``). Only a start: nothing here is checked, the float64 pivoting decides.
    ``cache``: the preconditioner's setups (:class:`~._precond.SetupCache`), kept for the
    float64 solves. ``start``: a cold start from :func:`~._projected.projected_start`
    instead, where ``Q`` (or its bulk) is well conditioned (:func:`~._projected.plan`).
    """
    q32, rhs = q.float(), -shift.float()
    pre = _as_preconditioner(h.float() if isinstance(h, Tensor) else h)
    b, k = rhs.shape
    cache = SetupCache(pre, b, k) if cache is None else cache
    first_moves = None  # a first solve far from the optimum: loose
    if start is not None and not bool(free0.any()):
        free, y, yq = projected_start(q32, -rhs, start)
        first_moves = torch.zeros(b, dtype=torch.int64)  # near it: to ROUGH_RTOL
    else:
        free, y, yq = opposite_start(pre.inverse, -rhs, free0, whole)
    out_free, out_y = free0.clone(), torch.zeros_like(rhs)
    count = torch.zeros(b, dtype=torch.int64)
    live = _Live(torch.arange(b), torch.zeros_like(rhs), y, yq, torch.zeros_like(rhs),
                 torch.zeros(b), torch.zeros_like(rhs), torch.zeros(b), count, count.clone(),
                 torch.full((b,), k + 1), count.clone())
    fresh = torch.ones(b, dtype=torch.bool)
    _restart(live, q32, rhs, free, fresh, cache, first_moves)
    due = torch.zeros(b, dtype=torch.bool)
    for _ in range(ROUGH_MAX_PIVOTS * ROUGH_MAX_STEPS):
        due = due | _step(live, q32, pre, fresh)
        fresh = torch.zeros_like(due)
        waiting = int(due.sum())
        if waiting * k < ROUGH_PIVOT_ENTRIES and waiting < due.numel():
            continue  # the rows done step on until enough of them make a pivot worth it
        stop, nxt, moves = _pivot(live, due, rhs, out_free, out_y)
        fresh[due] = ~stop
        _restart(live, q32, rhs, nxt[~stop], fresh, cache, moves[~stop])
        keep = ~due | fresh
        if not bool(keep.all()):
            fresh = fresh[keep]
            live.take(keep)
        due = torch.zeros_like(fresh)
        if live.rows.numel() == 0:
            break
    finite = torch.isfinite(out_y.sum(dim=1, keepdim=True))  # else: the given free set
    clean = either(finite, out_free & (out_y > 0.0), free0)
    overflowed = torch.nonzero(~finite.flatten()).flatten()
    out_y.index_fill_(0, overflowed, 0.0)  # then finite: a product by the mask is exact
    return clean, out_y.mul_(clean).add_(0.0).to(shift.dtype)  # + 0: no −0
