"""Batched active-set solver for box- (and simplex-) constrained QPs sharing one Hessian.

Not a balancer module (no ``__all__``). ``min ½ xᵀQx + cᵀx`` s.t. ``x ≥ lower`` (and
``Σ x = 1``), for ``B`` right-hand sides ``c``/``lower`` at once: the primal active-set method
of Nocedal & Wright (*Numerical Optimization*, Alg. 16.3) run on every problem in lock-step,
so a call costs one Python loop of few large tensor operations (one host sync per iteration)
instead of ``B`` separate loops of tiny ones.

Each iteration solves the equality-constrained subproblem on the free indices of every
problem at once, with the fixed indices masked out:

* ``Q`` positive definite (condition number below ``1e10``): every principal submatrix is too,
  and the masked systems ``Q_FF s = r`` are solved by one batched Cholesky factorisation (the
  simplex step uses two right-hand sides: ``s = −Q_FF⁻¹(∇ − ν1)``,
  ``ν = 1ᵀQ_FF⁻¹∇ / 1ᵀQ_FF⁻¹1``);
* otherwise the least-norm solution by a batched eigen-decomposition (the pseudo-inverse with
  relative cut-off ``1e-13`` of the subproblem, bordered by the constraint ``Σ s = 0`` for the
  simplex), exact when ``c`` lies in the range of ``Q``, as for every caller.

After a full step (or a zero one) the problem sits at its subproblem minimum and the bound
with the most negative multiplier is released in the same iteration; a blocked step fixes the
blocking bound. Problems that have converged are frozen while the others continue.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: Relative cut-off of the least-norm (pseudo-inverse) solves.
PINV_RTOL = 1e-13
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
    lam, vec = torch.linalg.eigh(mat)
    mag = lam.abs()
    keep = mag > PINV_RTOL * mag.amax(dim=1, keepdim=True)
    inv = torch.where(keep, 1.0 / torch.where(keep, lam, 1.0), 0.0)
    coef = (vec.transpose(1, 2) @ rhs[..., None])[..., 0] * inv
    return (vec @ coef[..., None])[..., 0][:, :k] * freef


def _solve_free(q: Tensor, rhs: Tensor, free: Tensor, total: Tensor | None) -> Tensor | None:
    """``y`` ``[B, K]`` with ``Q_FF y_F = rhs_F`` (``+ ν1`` and ``1ᵀy_F = total`` if given).

    Batched Cholesky (``Q`` positive definite); zero on the fixed indices; None if a
    factorisation fails.
    """
    freef = free.to(q.dtype)
    mat = q * (freef[:, :, None] * freef[:, None, :]) + torch.diag_embed(1.0 - freef)
    chol, info = torch.linalg.cholesky_ex(mat)
    if bool(info.any()):
        return None
    if total is not None:
        sol = torch.cholesky_solve(torch.stack([rhs * freef, freef], dim=-1), chol)
        nu = (total - sol[..., 0].sum(dim=1)) / sol[..., 1].sum(dim=1).clamp_min(1e-300)
        return (sol[..., 0] + nu[:, None] * sol[..., 1]) * freef
    return torch.cholesky_solve((rhs * freef)[..., None], chol)[..., 0] * freef


def solve_lcp_pivoting(
    q: Tensor, c: Tensor, lower: Tensor, simplex: bool, free0: Tensor, tol: float,
    max_iter: int,
) -> Tensor | None:
    """Block principal pivoting (Júdice & Pires 1994) for positive definite ``Q``.

    Optimality of ``y = x − lower ≥ 0`` is the complementarity problem ``w = Qy + c' − ν1 ≥ 0``
    (``c' = Q·lower + c``; ``ν`` and ``Σy = 1 − Σ lower`` only with the simplex), ``yᵀw = 0``.
    Given the free set ``F``, ``y_F`` solves the equalities and ``y`` is zero elsewhere; every
    index with ``y_F < −tol`` or ``w_A < −tol`` changes side at once, falling back to
    exchanging only the largest such index (Murty's rule, finite for positive definite ``Q``)
    after three exchanges that do not reduce their number. Typically 2–4 iterations for any
    ``K``. Returns None if ``max_iter`` does not suffice or a factorisation fails.
    """
    b, k = c.shape
    shift = lower @ q + c
    total = 1.0 - lower.sum(dim=1) if simplex else None
    free = free0.clone()
    best = torch.full((b,), k + 1, dtype=torch.int64)
    chances = torch.full((b,), 3, dtype=torch.int64)
    order = torch.arange(1, k + 1)
    for _ in range(max_iter):
        y = _solve_free(q, -shift, free, total)
        if y is None:
            return None
        w = y @ q + shift
        if simplex:
            freef = free.to(q.dtype)
            w = w - (w * freef).sum(dim=1, keepdim=True) / freef.sum(dim=1, keepdim=True)
        bad = torch.where(free, y < -tol, w < -tol)
        count = bad.sum(dim=1)
        if not bool(count.any()):
            return lower + y.clamp_min(0.0)
        better = count < best
        best = torch.where(better, count, best)
        chances = torch.where(better, 3, chances - 1)
        single = torch.nn.functional.one_hot((bad * order).argmax(dim=1), k).bool()
        free = free ^ torch.where((chances >= 0)[:, None], bad, single & bad)
        if simplex:  # Σy = total > 0 needs a free index: free the most attractive one
            empty = ~free.any(dim=1, keepdim=True)
            free = free | (empty & torch.nn.functional.one_hot(w.argmin(dim=1), k).bool())
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
    if well_conditioned:
        pivot = solve_lcp_pivoting(q, c, lower, simplex, x > lower, tol, 10 + 3 * k)
        if pivot is not None:
            return pivot
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
