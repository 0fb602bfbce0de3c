"""Batched solvers for box- (and simplex-) constrained QPs sharing one Hessian.

Not a balancer module (no ``__all__``). ``min ½ xᵀQx + cᵀx`` s.t. ``x ≥ lower`` (and
``Σ x = 1``), for ``B`` right-hand sides ``c``/``lower`` at once, every problem in lock-step:
a call costs one Python loop of few batched tensor operations (one host sync per iteration)
instead of ``B`` loops of tiny ones.

1. Block principal pivoting (Júdice & Pires 1994, with Murty's single-pivot safeguard)
   exchanges every infeasible index at once and typically finishes in 2–4 iterations for any
   ``K``. Its equality subproblems ``Q_FF y_F = r_F`` are solved with the fixed indices masked
   out: by one batched Cholesky factorisation when ``Q`` is positive definite (condition
   number below ``1e10``; every principal submatrix is then too), otherwise in the
   least-norm sense (a batched eigen-decomposition, pseudo-inverse cut-off ``1e-13``),
   bordered by ``Σ y = 1 − Σ lower`` for the simplex. It returns only points that satisfy
   every KKT condition to ``tol``.
2. Problems it leaves open (a singular ``Q`` can make it cycle) go to the primal active-set
   method of Nocedal & Wright (*Numerical Optimization*, Alg. 16.3), which always terminates:
   after a full (or zero) step the problem sits at its subproblem minimum and the bound with
   the most negative multiplier is released in the same iteration; a blocked step fixes the
   blocking bound. Least-norm steps are exact when ``c`` lies in the range of ``Q``, as for
   every caller.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Relative cut-off of the least-norm (pseudo-inverse) solves.
PINV_RTOL = 1e-13
#: Largest ``|Q_FF y_F − rhs_F|`` accepted from a least-norm solve in the pivoting method.
_RESIDUAL_TOL = 1e-10
#: Largest condition number of ``Q`` for which the Cholesky path is used.
CHOLESKY_MAX_COND = 1e10


def is_well_conditioned(q: Tensor) -> bool:
    """``Q`` symmetric positive definite with condition number below ``1e10`` (one host sync)."""
    lam = torch.linalg.eigvalsh(q)
    return bool(lam[0] > lam[-1] / CHOLESKY_MAX_COND) and bool(lam[-1] > 0)


def _step_cholesky(q: Tensor, grad: Tensor, free: Tensor, simplex: bool) -> Tensor | None:
    """Subproblem steps ``[B, K]`` by batched Cholesky; None if a factorisation fails."""
    freef = free.to(q.dtype)
    mat = q * (freef[:, :, None] * freef[:, None, :]) + torch.diag_embed(1.0 - freef)
    chol, info = torch.linalg.cholesky_ex(mat)
    if bool(info.any()):
        return None
    if simplex:
        sol = torch.cholesky_solve(torch.stack([grad * freef, freef], dim=-1), chol)
        nu = sol[..., 0].sum(dim=1) / sol[..., 1].sum(dim=1).clamp_min(1e-300)
        return -(sol[..., 0] - nu[:, None] * sol[..., 1]) * freef
    return -torch.cholesky_solve((grad * freef)[..., None], chol)[..., 0] * freef


def _step_pinv(q: Tensor, grad: Tensor, free: Tensor, simplex: bool) -> Tensor:
    """Least-norm subproblem steps ``[B, K]`` by a batched eigen-decomposition."""
    b, k = grad.shape
    freef = free.to(q.dtype)
    mat = q * (freef[:, :, None] * freef[:, None, :])
    rhs = -grad * freef
    if simplex:
        border = torch.zeros(b, k + 1, k + 1, dtype=q.dtype)
        border[:, :k, :k] = mat
        border[:, :k, k] = freef
        border[:, k, :k] = freef
        mat = border
        rhs = torch.cat([rhs, torch.zeros(b, 1, dtype=q.dtype)], dim=1)
    lam: Tensor
    vec: Tensor
    lam, vec = torch.linalg.eigh(mat)
    mag = lam.abs()
    keep = mag > PINV_RTOL * mag.amax(dim=1, keepdim=True)
    inv = torch.where(keep, 1.0 / torch.where(keep, lam, 1.0), 0.0)
    coef = (vec.transpose(1, 2) @ rhs[..., None])[..., 0] * inv
    return (vec @ coef[..., None])[..., 0][:, :k] * freef


def _solve_free(q: Tensor, rhs: Tensor, free: Tensor, total: Tensor | None,
                well_conditioned: bool) -> Tensor | None:
    """``y`` ``[B, K]`` with ``Q_FF y_F = rhs_F`` (``+ ν1`` and ``1ᵀy_F = total`` if given).

    Zero on the fixed indices. Batched Cholesky when ``Q`` is well conditioned (None if a
    factorisation fails), else the least-norm solution by a batched eigen-decomposition (the
    pseudo-inverse of ``Q_FF``, bordered by ``1ᵀy_F = total`` for the simplex).
    """
    freef = free.to(q.dtype)
    masked = q * (freef[:, :, None] * freef[:, None, :])
    if not well_conditioned:
        b, k = rhs.shape
        mat, vec = masked, rhs * freef
        if total is not None:  # [[Q_FF, 1], [1ᵀ, 0]] [y; −ν] = [rhs; total]
            mat = torch.zeros(b, k + 1, k + 1, dtype=q.dtype)
            mat[:, :k, :k] = masked
            mat[:, :k, k] = freef
            mat[:, k, :k] = freef
            vec = torch.cat([vec, total[:, None]], dim=1)
        lam: Tensor
        basis: Tensor
        lam, basis = torch.linalg.eigh(mat)
        mag = lam.abs()
        keep = mag > PINV_RTOL * mag.amax(dim=1, keepdim=True)
        inv = torch.where(keep, 1.0 / torch.where(keep, lam, 1.0), 0.0)
        coef = (basis.transpose(1, 2) @ vec[..., None])[..., 0] * inv
        return (basis @ coef[..., None])[..., 0][:, :k] * freef
    chol, info = torch.linalg.cholesky_ex(masked + torch.diag_embed(1.0 - freef))
    if bool(info.any()):
        return None
    if total is not None:
        sol = torch.cholesky_solve(torch.stack([rhs * freef, freef], dim=-1), chol)
        nu = (total - sol[..., 0].sum(dim=1)) / sol[..., 1].sum(dim=1).clamp_min(1e-300)
        return (sol[..., 0] + nu[:, None] * sol[..., 1]) * freef
    return torch.cholesky_solve((rhs * freef)[..., None], chol)[..., 0] * freef


def solve_lcp_pivoting(
    q: Tensor, c: Tensor, lower: Tensor, simplex: bool, free0: Tensor, tol: float,
    max_iter: int, well_conditioned: bool = True,
) -> tuple[Tensor, Tensor] | None:
    """Block principal pivoting (Júdice & Pires 1994): ``(x, done)``, ``x`` valid where done.

    Optimality of ``y = x − lower ≥ 0`` is the complementarity problem ``w = Qy + c' − ν1 ≥ 0``
    (``c' = Q·lower + c``; ``ν`` and ``Σy = 1 − Σ lower`` only with the simplex), ``yᵀw = 0``.
    Given the free set ``F``, ``y_F`` solves the equalities and ``y`` is zero elsewhere; every
    index with ``y_F < −tol`` or ``w_A < −tol`` changes side at once, falling back to
    exchanging only the largest such index (Murty's rule, finite for positive definite ``Q``)
    after three exchanges that do not reduce their number. Typically 2–4 iterations for any
    ``K``. For a singular ``Q`` (least-norm solves) termination is not guaranteed and the
    equalities ``w_F = 0`` are verified too; the answer is returned only at a point that
    satisfies every KKT condition to ``tol``. Problems still open after ``max_iter``
    iterations, or whose least-norm solve is not a solution, are returned with ``done``
    False (the caller runs the active-set method on them); None if a factorisation fails.
    """
    b, k = c.shape
    shift = lower @ q + c
    total = 1.0 - lower.sum(dim=1) if simplex else None
    free = free0.clone()
    best = torch.full((b,), k + 1, dtype=torch.int64)
    chances = torch.full((b,), 3, dtype=torch.int64)
    order = torch.arange(1, k + 1)
    start_empty = not simplex and not bool(free.any())
    x = lower.clone()
    done = torch.zeros(b, dtype=torch.bool)
    failed = torch.zeros(b, dtype=torch.bool)
    for _ in range(max_iter):
        # From an empty free set (the default start of a box QP) y = 0 needs no solve.
        if start_empty:
            y: Tensor | None = torch.zeros_like(shift)
            start_empty = False
        else:
            y = _solve_free(q, -shift, free, total, well_conditioned)
        if y is None:
            return None
        w = y @ q + shift
        if simplex:
            freef = free.to(q.dtype)
            w = w - (w * freef).sum(dim=1, keepdim=True) / freef.sum(dim=1, keepdim=True)
        if not well_conditioned:
            # A least-norm solve that is not a solution is not a KKT point: give up there.
            failed = failed | (free & (w.abs() > _RESIDUAL_TOL)).any(dim=1)
        bad = torch.where(free, y < -tol, w < -tol)
        count = bad.sum(dim=1)
        finished = (count == 0) & ~failed & ~done
        x = torch.where(finished[:, None], lower + y.clamp_min(0.0), x)
        done = done | finished
        if bool((done | failed).all()):
            return x, done
        better = count < best
        best = torch.where(better, count, best)
        chances = torch.where(better, 3, chances - 1)
        single = torch.nn.functional.one_hot((bad * order).argmax(dim=1), k).bool()
        free = free ^ torch.where((chances >= 0)[:, None], bad, single & bad)
        if simplex:  # Σy = total > 0 needs a free index: free the most attractive one
            none_free = ~free.any(dim=1, keepdim=True)
            free = free | (none_free & torch.nn.functional.one_hot(w.argmin(dim=1), k).bool())
    return x, done


def _pivot_single(
    q: Tensor, c: Tensor, lower: Tensor, simplex: bool, free0: list[bool], tol: float,
    max_iter: int, well_conditioned: bool,
) -> Tensor | None:
    """:func:`solve_lcp_pivoting` for one problem (``c``, ``lower`` ``[K]``).

    The same iterations, with the pivoting decisions made on Python lists (one host sync per
    iteration) and the subproblem solved on the free indices only: a few tensor operations
    per iteration instead of dozens of masked ones. None when it does not finish.
    """
    k = c.shape[0]
    shift = lower @ q + c
    total = 1.0 - float(lower.sum()) if simplex else 0.0
    free = list(free0)
    best, chances = k + 1, 3
    for _ in range(max_iter):
        idx = [i for i in range(k) if free[i]]
        y = torch.zeros(k, dtype=q.dtype)
        if idx:
            sel = torch.tensor(idx)
            sub = q[sel][:, sel]
            rhs = -shift[sel]
            if well_conditioned:
                chol, info = torch.linalg.cholesky_ex(sub)
                if int(info) != 0:
                    return None
                if simplex:
                    sol = torch.cholesky_solve(torch.stack([rhs, torch.ones_like(rhs)], 1), chol)
                    nu = (total - sol[:, 0].sum()) / sol[:, 1].sum()
                    y[sel] = sol[:, 0] + nu * sol[:, 1]
                else:
                    y[sel] = torch.cholesky_solve(rhs[:, None], chol)[:, 0]
            else:
                if simplex:  # [[Q_FF, 1], [1ᵀ, 0]] [y; −ν] = [rhs; total]
                    n = len(idx)
                    border = torch.zeros(n + 1, n + 1, dtype=q.dtype)
                    border[:n, :n] = sub
                    border[:n, n] = 1.0
                    border[n, :n] = 1.0
                    sub = border
                    rhs = torch.cat([rhs, torch.tensor([total], dtype=q.dtype)])
                sol = torch.linalg.pinv(sub, hermitian=True, rtol=PINV_RTOL) @ rhs
                y[sel] = sol[: len(idx)]
        w = q @ y + shift
        y_l, w_l = torch.stack([y, w]).tolist()
        if simplex:
            nu_v = sum(w_l[i] for i in idx) / len(idx)
            w_l = [v - nu_v for v in w_l]
        if not well_conditioned and any(abs(w_l[i]) > _RESIDUAL_TOL for i in idx):
            return None  # a least-norm solve that is not a solution: not a KKT point
        bad = [i for i in range(k) if (y_l[i] < -tol if free[i] else w_l[i] < -tol)]
        if not bad:
            return lower + y.clamp_min(0.0)
        if len(bad) < best:
            best, chances = len(bad), 3
        else:
            chances -= 1
        for i in bad if chances >= 0 else bad[-1:]:
            free[i] = not free[i]
        if simplex and not any(free):  # Σy = total > 0 needs a free index
            free[min(range(k), key=w_l.__getitem__)] = True
    return None


def _active_set_single(
    q: Tensor, c: Tensor, lower: Tensor, simplex: bool, x: Tensor, tol: float, max_iter: int,
) -> Tensor | None:
    """:func:`_active_set` for one problem (``[K]``), on the free submatrix (least-norm).

    Cheaper than the masked batched form when ``Q`` is singular: each pseudo-inverse is of
    the free block only. Separate subproblem and release iterations, as in the textbook.
    """
    k = q.shape[0]
    dtype = q.dtype
    fixed = x <= lower
    if simplex and bool(fixed.all()):
        fixed[int(torch.argmax(x))] = False
    for _ in range(max_iter):
        grad = q @ x + c
        idx = torch.nonzero(~fixed).flatten()
        n = idx.numel()
        step = torch.zeros(k, dtype=dtype)
        if n:
            sub = q[idx][:, idx]
            rhs = -grad[idx]
            if simplex:
                border = torch.zeros(n + 1, n + 1, dtype=dtype)
                border[:n, :n] = sub
                border[:n, n] = 1.0
                border[n, :n] = 1.0
                sub = border
                rhs = torch.cat([rhs, torch.zeros(1, dtype=dtype)])
            step[idx] = (torch.linalg.pinv(sub, hermitian=True, rtol=PINV_RTOL) @ rhs)[:n]
        if float(step.abs().max()) <= tol * (1.0 + float(x.abs().max())):
            # Subproblem minimum: check the multipliers of the bounds held fixed.
            mult = grad - grad[idx].mean() if simplex and n else grad
            mult = torch.where(fixed, mult, torch.zeros_like(mult))
            worst = int(torch.argmin(mult))
            if float(mult[worst]) >= -tol:
                return x
            fixed[worst] = False
            continue
        neg = ~fixed & (step < 0)
        ratios = torch.where(neg, (lower - x) / torch.where(neg, step, -1.0),
                             torch.full_like(x, float("inf")))
        block = int(torch.argmin(ratios))
        alpha = min(1.0, float(ratios[block]))
        x = x + alpha * step
        if alpha < 1.0:
            x[block] = lower[block]
            fixed[block] = True
    return None


def solve_box_qp_batched(
    q: Tensor,
    c: Tensor,
    lower: Tensor,
    simplex: bool = False,
    x0: Tensor | None = None,
    tol: float = 1e-12,
    max_iter: int | None = None,
    well_conditioned: bool | None = None,
) -> Tensor | None:
    """``[B, K]`` minimisers of ``½ xᵀ q x + c_bᵀx`` s.t. ``x ≥ lower_b`` (``Σ x = 1``).

    ``q`` ``[K, K]`` symmetric PSD (trace-normalised) with every ``c_b`` in its range; ``c``,
    ``lower`` and the optional feasible start ``x0`` are ``[B, K]``, float64 on the CPU.
    ``well_conditioned`` selects the Cholesky path (computed from ``q`` when None). Returns
    None when ``max_iter`` (default ``50 + 20 K``) iterations do not suffice; the caller
    raises.
    """
    dtype = torch.float64
    b, k = c.shape
    q = q.to(dtype)
    c = c.to(dtype)
    lower = lower.to(dtype)
    if well_conditioned is None:
        well_conditioned = is_well_conditioned(q)
    if x0 is None:
        x = torch.full((b, k), 1.0 / k, dtype=dtype) if simplex else lower.clone()
        if simplex:
            x = torch.maximum(x, lower)
    else:
        x = x0.to(dtype).clone()
    budget = (10 + 3 * k if well_conditioned else 8) if max_iter is None else max_iter
    if b == 1:
        single = _pivot_single(q, c[0], lower[0], simplex, (x[0] > lower[0]).tolist(), tol,
                               budget, well_conditioned)
        if single is not None:
            return single[None]
        iters = 50 + 20 * k if max_iter is None else max_iter
        rest = _active_set_single(q, c[0], lower[0], simplex, x[0].clone(), tol, iters)
        return None if rest is None else rest[None]
    pivot = solve_lcp_pivoting(q, c, lower, simplex, x > lower, tol, budget, well_conditioned)
    if pivot is not None:
        x_piv, done = pivot
        if bool(done.all()):
            return x_piv
        # The open problems go to the active-set method (from their original start).
        open_rows = torch.nonzero(~done).flatten()
        rest = _active_set(q, c[open_rows], lower[open_rows], simplex, x[open_rows], tol,
                           max_iter, well_conditioned)
        if rest is None:
            return None
        x_piv[open_rows] = rest
        return x_piv
    return _active_set(q, c, lower, simplex, x, tol, max_iter, well_conditioned)


def _active_set(
    q: Tensor, c: Tensor, lower: Tensor, simplex: bool, x: Tensor, tol: float,
    max_iter: int | None, well_conditioned: bool,
) -> Tensor | None:
    """The primal active-set iterations (see the module docstring) from the feasible ``x``."""
    dtype = torch.float64
    b, k = c.shape
    fixed = x <= lower
    if simplex:
        fixed = fixed & ~torch.nn.functional.one_hot(x.argmax(dim=1), k).bool().logical_and(
            fixed.all(dim=1, keepdim=True))
    active = torch.ones(b, dtype=torch.bool)
    rows = torch.arange(b)
    inf = torch.tensor(float("inf"), dtype=dtype)
    max_iter = 50 + 20 * k if max_iter is None else max_iter
    for _ in range(max_iter):
        grad = x @ q + c
        free = ~fixed
        step = _step_cholesky(q, grad, free, simplex) if well_conditioned else None
        if step is None:
            step = _step_pinv(q, grad, free, simplex)
        small = step.abs().amax(dim=1) <= tol * (1.0 + x.abs().amax(dim=1))
        # Ratio test: the first bound a (non-small) step would cross.
        neg = free & (step < 0)
        ratios = torch.where(neg, (lower - x) / torch.where(neg, step, -1.0), inf)
        rmin, block = ratios.min(dim=1)
        moving = active & ~small
        alpha = torch.where(moving, rmin.clamp(max=1.0), 0.0)
        x = x + alpha[:, None] * step
        blocked = moving & (rmin < 1.0)
        hit = torch.zeros_like(fixed)
        hit[rows, block] = blocked
        x = torch.where(hit, lower, x)
        fixed = fixed | hit
        # At the subproblem minimum: the multipliers of the bounds held fixed.
        at_min = active & ~blocked
        grad = x @ q + c
        mult = grad
        if simplex:
            freef = (~fixed).to(dtype)
            mult = grad - (grad * freef).sum(dim=1, keepdim=True) / freef.sum(
                dim=1, keepdim=True).clamp_min(1.0)
        mult = torch.where(fixed, mult, inf)
        worst_val, worst = mult.min(dim=1)
        release = at_min & (worst_val < -tol)
        fixed[rows, worst] = fixed[rows, worst] & ~release
        active = active & ~(at_min & ~release)
        if not bool(active.any()):
            return x
    return None
