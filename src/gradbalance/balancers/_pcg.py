"""Conjugate-gradient solves on the free sets of many box QPs sharing one ``Q``.

Not a balancer module (no ``__all__``). The pivoting of :mod:`._boxqp` on ``B`` problems
(UPGrad's K projections) needs ``Q_FF y_F = rhs_F`` for a different free set ``F`` per
problem; here all of them take their conjugate-gradient steps together, two
``[B, K] × [K, K]`` products per step (:func:`pcg_free`). :func:`rough_free_sets` runs the
same block pivoting in float32 with loose solves (half the cost of a product, a quarter of
the steps): a guess of each problem's free set and solution, which the float64 pivoting then
only confirms (one tight solve and the optimality test) or corrects.
"""

from __future__ import annotations

import torch
from torch import Tensor

_norm = torch.linalg.vector_norm  # the direct kernel: Tensor.norm dispatches in Python first
_dot = torch.linalg.vecdot  # row-wise inner products, one pass

#: Step cap of one solve.
CG_MAX_STEPS = 100
#: Relative residual of the float32 solves of :func:`rough_free_sets` and their step cap,
#: the fraction of a row's largest ``|y|`` (or ``|w|``) below which a sign there is not
#: trusted, and its pivoting iterations.
ROUGH_RTOL = 1e-6
ROUGH_MAX_STEPS = 20
ROUGH_MARGIN = 1e-5
ROUGH_MAX_PIVOTS = 8


def restricted_product(q: Tensor, y0: Tensor, y0q: Tensor, f: Tensor) -> Tensor:
    """``(y0 ∘ f) Q`` from ``y0 Q``: the rows of ``Q`` of the few entries ``f`` drops are
    subtracted (one ``[B, K] × [K, K]`` product instead when they are many)."""
    dropped = y0 * (1.0 - f)
    bi, ki = torch.nonzero(dropped, as_tuple=True)
    if 8 * bi.numel() > dropped.numel():
        return (y0 * f) @ q
    return y0q.index_add(0, bi, -dropped[bi, ki][:, None] * q[ki])


def pcg_free(q: Tensor, h: Tensor, rhs: Tensor, free: Tensor, y0: Tensor, y0q: Tensor,
             rtol: Tensor, max_steps: int = CG_MAX_STEPS) -> tuple[Tensor, Tensor, Tensor]:
    """``(y, converged, yQ)`` (``[B, K]``, ``[B]``, ``[B, K]``): ``Q_FF y_F = rhs_F`` per row,
    ``y`` zero off ``F``; ``y0q = y0 Q`` (the last solve's product).

    Conjugate gradients preconditioned by ``(Q⁻¹)_FF`` (``h = Q⁻¹``), from ``y0``: two
    ``[B, K] × [K, K]`` products per step for all the problems together, until the residual
    is ``rtol`` ``[B]`` times ``‖rhs_F‖``, at most ``max_steps`` steps, in the dtype of
    ``q``. ``yQ`` is carried along the iterations from ``y0q`` (the unmasked operator
    products), so neither the start nor the caller's multipliers need a product of their own.
    """
    f = free.to(q.dtype)
    y = y0 * f
    yq = restricted_product(q, y0, y0q, f)
    r = (rhs - yq) * f
    target = rtol * _norm(rhs * f, dim=1)
    converged = _norm(r, dim=1) <= target
    live = torch.nonzero(~converged).flatten()  # rows still iterating: the others drop out
    f, r, target, x, xq = f[live], r[live], target[live], y[live], yq[live]
    z = (r @ h).mul_(f)
    p, rz = z, _dot(r, z)
    for _ in range(max_steps):
        if live.numel() == 0:
            break
        pq = p @ q
        pap = _dot(p, pq)  # p is zero off F: pᵀQ_FF p
        alpha = torch.where(pap > 0, rz / torch.where(pap > 0, pap, 1.0), 0.0)[:, None]
        x.addcmul_(alpha, p)
        xq.addcmul_(alpha, pq)
        r.addcmul_(pq, f * alpha, value=-1.0)
        ok = _norm(r, dim=1) <= target
        stop = ok | (pap <= 0)  # converged, or broken down (left unconverged)
        if bool(stop.any()):
            done = live[stop]
            y[done], yq[done], converged[done] = x[stop], xq[stop], ok[stop]
            keep = ~stop
            live, f, r, target, x, xq, p, rz = (
                t[keep] for t in (live, f, r, target, x, xq, p, rz))
        z = (r @ h).mul_(f)
        rz_new = _dot(r, z)
        p = p.mul_(torch.where(rz > 0, rz_new / torch.where(rz > 0, rz, 1.0), 0.0)[:, None])
        p.add_(z)
        rz = rz_new
    y[live], yq[live] = x, xq
    return y, converged, yq


def rough_free_sets(q: Tensor, h: Tensor, shift: Tensor,
                    free0: Tensor) -> tuple[Tensor, Tensor]:
    """``(free, y)`` ``[B, K]`` (float64): a guess of each box problem's optimal free set and
    ``y`` (``w = Qy + shift ≥ 0``, ``y ≥ 0``, ``yᵀw = 0``), from the free sets ``free0``.

    Block principal pivoting (Júdice & Pires 1994) in float32 with :func:`pcg_free` solves
    to ``ROUGH_RTOL``: every index whose ``y`` or ``w`` is below ``−ROUGH_MARGIN`` times the
    row's largest ``|y|`` or ``|w|`` changes side; a problem stops when none does, when their
    number has not fallen for two iterations, or after ``ROUGH_MAX_PIVOTS``; a free index
    whose ``y`` is not positive leaves, and a problem whose float32 solve overflowed keeps
    ``free0`` (and ``y = 0``). Only a start: nothing here is checked, the float64 pivoting
    decides.
    """
    q32, h32, rhs = q.float(), h.float(), -shift.float()
    b = rhs.shape[0]
    rows = torch.arange(b)
    free, out_free, out_y = free0, free0.clone(), torch.zeros_like(shift)
    y, yq = torch.zeros_like(rhs), torch.zeros_like(rhs)
    best = torch.full((b,), shift.shape[1] + 1)
    stale = torch.zeros(b, dtype=torch.int64)
    loose = torch.full((b,), ROUGH_RTOL, dtype=torch.float32)
    for _ in range(ROUGH_MAX_PIVOTS):
        y, _, yq = pcg_free(q32, h32, rhs[rows], free, y, yq, loose[: rows.numel()],
                            ROUGH_MAX_STEPS)
        w = yq - rhs[rows]
        margin_y = ROUGH_MARGIN * y.abs().amax(dim=1, keepdim=True)
        margin_w = ROUGH_MARGIN * w.abs().amax(dim=1, keepdim=True)
        bad = torch.where(free, y < -margin_y, w < -margin_w)
        count = bad.sum(dim=1)
        out_free[rows], out_y[rows] = free, y.double()
        better = count < best[rows]
        best[rows] = torch.minimum(count, best[rows])
        stale[rows] = torch.where(better, 0, stale[rows] + 1)
        keep = (count > 0) & (stale[rows] < 2)
        rows, free, bad, y, yq = (t[keep] for t in (rows, free, bad, y, yq))
        if rows.numel() == 0:
            break
        free = free ^ bad
    finite = torch.isfinite(out_y).all(dim=1, keepdim=True)  # else: the given free set
    clean = torch.where(finite, out_free & (out_y > 0.0), free0)
    return clean, torch.where(clean & finite, out_y, 0.0)
