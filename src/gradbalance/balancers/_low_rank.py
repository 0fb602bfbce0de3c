"""Many box QPs on one low-rank ``Q``: non-negative least squares in the rank's dimension.

Not a balancer module (no ``__all__``). ``min ½ vᵀQv`` s.t. ``v ≥ lowerᵦ`` depends on ``Q``
only through ``x = Lᵀv`` with ``Q ≈ L Lᵀ``, ``L`` ``[K, r]`` from a pivoted Cholesky
factorisation (Higham 2002, *Accuracy and Stability of Numerical Algorithms*, §10.3) stopped
once every residual diagonal entry is at most ``τ = SCHUR_RTOL_PER_ROW · K`` times its
own diagonal entry: for a positive semi-definite ``Q`` the residual ``Q − LLᵀ`` is too, so
each row ``gᵢ`` of a Gramian ``Q = G Gᵀ`` is replaced by its projection on the span of ``r``
pivot rows, at a distance of at most ``√τ ‖gᵢ‖`` (``√τ ≈ 10⁻⁶`` at ``K = 1,024``); a
rounding-level negative part of ``Q`` adds its own size. A Gramian multiplied in float32 is
rounded far above ``τ`` (``≈ 10⁻⁷``), which hides a low rank: it keeps the dense route. With
``v = lower + μ`` each problem is the ``r``-dimensional NNLS ``min_{μ ≥ 0} ‖Lᵀlower +
Lᵀμ‖`` (``K`` columns of length ``r``), solved by Lawson & Hanson (1974, *Solving Least
Squares Problems*, Ch. 23) for all problems in the same tensor operations: one column
enters each open problem per iteration, its passive columns stay independent (at most ``r``
of them), and a step costs ``O(rK + r³)`` per problem (the multipliers, the passive block's
Cholesky factor) instead of ``O(mK)`` on passive sets ``m`` that reach hundreds. The
weights need not be unique, the update ``Lᵀv`` is.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._active_set import SCHUR_RTOL_PER_ROW, _to_boundary, solve_free

#: Fewest tasks for which the low-rank route is tried (below, the dense solve is cheap).
LOW_RANK_MIN_SIZE = 16
#: Largest rank taken by the low-rank route: ``K/8``, and at most ``LOW_RANK_MAX_WORK / K``
#: (measured: above, its refactorised passive blocks cost more than the dense active set's
#: updated ones; benchmarks/results/many_tasks_cpu.md).
LOW_RANK_MAX_FRACTION = 0.125
LOW_RANK_MAX_WORK = 8192


def pivoted_cholesky(q: Tensor, max_rank: int) -> Tensor | None:
    """``L`` ``[K, r]`` with ``Q − LLᵀ`` positive semi-definite and each diagonal entry at
    most ``τ Qᵢᵢ`` (module docstring), or None when that needs more than ``max_rank``
    columns. ``O(K r²)``: the rank is revealed before any ``O(K³)`` work."""
    k = q.shape[0]
    resid = torch.diagonal(q).clamp_min(0.0).clone()
    cut = SCHUR_RTOL_PER_ROW * k * resid
    cols: list[Tensor] = []
    factor = q.new_zeros(k, 0)
    while True:
        j = int(resid.argmax())
        top = float(resid[j])
        if top <= 0.0 or not bool((resid > cut).any()):
            return factor
        if len(cols) >= max_rank:
            return None
        col = (q[:, j] - factor @ factor[j]) / math.sqrt(top)
        col[resid <= 0.0] = 0.0
        cols.append(col)
        factor = torch.stack(cols, dim=1)
        resid = (resid - col * col).clamp_min_(0.0)
        resid[j] = 0.0


class _Open:
    """The open problems: their rows, ``Lᵀlower``, ``LLᵀlower``, ``μ ≥ 0``, the passive and
    set-aside sets; ``q = LLᵀ`` (formed once, ``O(K²r)``: the blocks are gathered from it)."""

    def __init__(self, factor: Tensor, lower: Tensor) -> None:
        b, k = lower.shape
        self.q = factor @ factor.T
        self.rows = torch.arange(b)
        self.a = lower @ factor
        self.shift = self.a @ factor.T
        self.mu = torch.zeros(b, k, dtype=factor.dtype)
        self.passive = torch.zeros(b, k, dtype=torch.bool)
        self.aside = torch.zeros(b, k, dtype=torch.bool)

    def keep(self, mask: Tensor) -> None:
        """Only the problems where ``mask`` stay open."""
        for name in ("rows", "a", "shift", "mu", "passive", "aside"):
            setattr(self, name, getattr(self, name)[mask])


def _passive_solve(st: _Open, sel: Tensor, passive: Tensor) -> Tensor:
    """``z`` ``[len(sel), K]``: ``argmin ‖aᵦ + Σ_{j∈P} zⱼ Lⱼ‖`` on each passive set (zero off
    it), the normal equations ``(LLᵀ)_PP z_P = −(LLᵀ lower)_P`` by one batched Cholesky
    factorisation of the gathered ``[m, m]`` blocks (:func:`~._active_set.solve_free`)."""
    return solve_free(st.q, -st.shift[sel], passive, None)


def _entering(factor: Tensor, st: _Open, norms: Tensor, tol: float) -> Tensor:
    """Each open problem's entering column, ``−1`` where none: the largest scaled
    multiplier ``wⱼ/‖Lⱼ‖`` (``w = −L x``, ``x = Lᵀv``) above ``tol ‖x‖ ‖Lⱼ‖`` and rounding."""
    x = st.a + st.mu @ factor
    w = -(x @ factor.T)
    size = x.norm(dim=1, keepdim=True)
    noise = 8 * SCHUR_RTOL_PER_ROW * (st.a.norm(dim=1, keepdim=True) + size)
    ok = ~(st.passive | st.aside) & (norms > 0.0)
    ok &= w > torch.maximum(tol * size, noise) * norms
    score = torch.where(ok, w / torch.where(norms > 0.0, norms, 1.0), -math.inf)
    return torch.where(ok.any(dim=1), score.argmax(dim=1), -1)


def _add(st: _Open, t: Tensor) -> None:
    """``t`` enters each open problem; where the solve gives it no positive value it is set
    aside, else ``μ`` moves towards the passive solves (Lawson–Hanson steps 7–11)."""
    rows = torch.arange(t.shape[0])
    passive = st.passive.clone()
    passive[rows, t] = True
    z = _passive_solve(st, rows, passive)
    good = z[rows, t] > 0.0  # False on a NaN row: a block that did not factorise
    st.aside[rows[~good], t[~good]] = True
    sel = rows[good]
    if not sel.numel():
        return
    mu, passive, z = st.mu[sel], passive[sel], z[sel]
    while True:
        moving = (passive & (z <= 0.0)).any(dim=1)
        if not bool(moving.any()):
            break
        mm, pm = _to_boundary(mu[moving], z[moving], passive[moving])
        mu[moving], passive[moving] = mm, pm
        z[moving] = _passive_solve(st, sel[moving], pm).nan_to_num()
    st.mu[sel] = torch.where(passive, z, 0.0)
    st.passive[sel] = passive
    st.aside[sel] = False


def low_rank_box(factor: Tensor, lower: Tensor, tol: float,
                 max_additions: int) -> tuple[Tensor, Tensor]:
    """``(v, done)`` ``[B, K]``, ``[B]``: ``argmin ½ vᵀLLᵀv`` s.t. ``v ≥ lowerᵦ`` where done
    (no multiplier above ``tol ‖Lᵀv‖ ‖Lⱼ‖``), ``lower`` elsewhere (open after
    ``max_additions``)."""
    out, done = lower.clone(), torch.zeros(lower.shape[0], dtype=torch.bool)
    norms = factor.norm(dim=1)
    st = _Open(factor, lower)
    for _ in range(max_additions + 1):
        t = _entering(factor, st, norms, tol)
        finished = t < 0
        out[st.rows[finished]] = lower[st.rows[finished]] + st.mu[finished]
        done[st.rows[finished]] = True
        st.keep(~finished)
        if not st.rows.numel():
            break
        _add(st, t[~finished])
    return out, done


def low_rank_projection(q: Tensor, lower: Tensor, tol: float) -> tuple[Tensor, Tensor] | None:
    """``(v, done)``: the box QPs of ``lower`` ``[B, K]`` on ``q`` by :func:`low_rank_box`
    for two or more problems (UPGrad's, not DualProj's one) when ``K ≥ LOW_RANK_MIN_SIZE``
    and ``q``'s numerical rank is at most
    ``LOW_RANK_MAX_FRACTION · K`` and ``LOW_RANK_MAX_WORK / K``; else None (the caller's
    dense solve)."""
    k = q.shape[0]
    if k < LOW_RANK_MIN_SIZE or lower.shape[0] < 2:  # one problem: the dense pivoting is cheaper
        return None
    factor = pivoted_cholesky(q, min(int(LOW_RANK_MAX_FRACTION * k), LOW_RANK_MAX_WORK // k))
    if factor is None:
        return None
    return low_rank_box(factor, lower, tol, 3 * factor.shape[1] + 10)
