"""K-dimensional solvers shared by the Gramian-based balancers (torch only, float64).

All solvers work on a ``[K, K]`` Gramian ``G = J Jᵀ`` (symmetric positive semi-definite) that
the caller has normalised by its trace, so the tolerances below are absolute on a problem whose
largest entry is at most 1. They run on the CPU (the problems are tiny and branchy) and raise
:class:`SolverError` when they do not converge: they never fall back to uniform weights.

* :func:`solve_box_qp` — ``min ½ xᵀQx + cᵀx`` s.t. ``x ≥ lower`` and optionally ``Σ x = 1``:
  a primal active-set method (Nocedal & Wright, *Numerical Optimization*, Alg. 16.3). Each
  equality-constrained subproblem is solved in the least-norm sense (pseudo-inverse), which is
  exact when ``c`` lies in the range of ``Q`` — true for every use here.
* :func:`min_norm_simplex` — MGDA's min-norm point of the convex hull of the rows.
* :func:`project_dual_cone` — UPGrad/DualProj: ``min vᵀGv`` s.t. ``v ≥ u``, whose solution
  ``Jᵀv`` is the projection of ``Jᵀu`` onto the dual cone ``{x : Jx ≥ 0}``.
* :func:`cagrad_dual` — CAGrad's dual ``min_{w∈Δ} wᵀG u + r‖Jᵀw‖`` by a monotone
  one-dimensional search over an auxiliary norm variable, each point one simplex QP.
* :func:`nash_bargaining` — Nash-MTL's ``G α = 1/α``, ``α > 0`` by damped Newton on the
  strictly convex ``½ αᵀGα − Σ log αᵢ``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["SolverError"]

#: Optimality tolerance of the active-set QP (on a trace-normalised Gramian).
QP_TOL = 1e-12


class SolverError(RuntimeError):
    """A K-dimensional solver did not converge; no balancer state was changed."""


def trace_normalized(gramian: Tensor) -> tuple[Tensor, Tensor]:
    """``(G / tr G, tr G)`` on the CPU in float64; a zero Gramian is returned unchanged.

    Dividing by the trace makes every solver tolerance scale-free, so a balancer gives the
    same weights for ``G`` and ``s·G`` up to rounding (1e-8 … 1e8 scales included).
    """
    gram = gramian.detach().to(device="cpu", dtype=torch.float64)
    gram = 0.5 * (gram + gram.T)
    trace = torch.diagonal(gram).sum()
    if float(trace) > 0.0:
        return gram / trace, trace
    return gram, trace


def check_pref(pref: Tensor | None, k: int, default: float) -> Tensor:
    """A preference vector ``[K]`` (float64, CPU, finite, non-negative); ``default`` if None."""
    if pref is None:
        return torch.full((k,), default, dtype=torch.float64)
    if pref.numel() != k:
        raise ValueError(
            f"Invalid pref: {pref.numel()} entries for {k} tasks (expected one entry per task)"
        )
    vec = pref.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    if not bool(torch.isfinite(vec).all()) or bool((vec < 0).any()):
        raise ValueError(f"Invalid pref: {vec.tolist()} (expected finite numbers >= 0)")
    return vec


def as_pref(pref: object) -> Tensor | None:
    """Validate a preference vector given at construction (shape only; length at call time)."""
    if pref is None:
        return None
    vec = torch.as_tensor(pref, dtype=torch.float64).detach().clone().reshape(-1)
    if vec.numel() == 0 or not bool(torch.isfinite(vec).all()) or bool((vec < 0).any()):
        raise ValueError(f"Invalid pref: {vec.tolist()} (expected K finite numbers >= 0)")
    return vec


def _lstsq_sym(matrix: Tensor, rhs: Tensor) -> Tensor:
    """Least-norm solution of a small symmetric (possibly singular) system."""
    return torch.linalg.pinv(matrix, hermitian=True, rtol=1e-13) @ rhs


def solve_box_qp(
    q: Tensor,
    c: Tensor,
    lower: Tensor,
    simplex: bool = False,
    x0: Tensor | None = None,
    tol: float = QP_TOL,
    max_iter: int | None = None,
) -> Tensor:
    """Minimise ``½ xᵀ q x + cᵀx`` subject to ``x ≥ lower`` (and ``Σ x = 1`` if ``simplex``).

    Primal active-set method: the working set holds the indices fixed at their bound; each
    iteration solves the subproblem on the free indices (least-norm), steps to the first
    blocking bound, or, at a subproblem minimum, releases the bound with the most negative
    multiplier. Terminates in finitely many steps; raises :class:`SolverError` after
    ``max_iter`` (default ``50 + 20 K``) iterations. ``q`` must be symmetric PSD with ``c`` in
    its range (true for all callers). ``x0`` must be feasible.
    """
    k = q.shape[0]
    dtype = torch.float64
    q = q.to(dtype)
    c = c.to(dtype)
    lower = lower.to(dtype)
    if x0 is None:
        x = torch.full((k,), 1.0 / k, dtype=dtype) if simplex else lower.clone()
        if simplex:
            x = torch.maximum(x, lower)
    else:
        x = x0.to(dtype).clone()
    fixed = x <= lower + 0.0
    if simplex and bool(fixed.all()):
        fixed[int(torch.argmax(x))] = False
    max_iter = 50 + 20 * k if max_iter is None else max_iter
    for _ in range(max_iter):
        grad = q @ x + c
        free = ~fixed
        idx = torch.nonzero(free).flatten()
        n = idx.numel()
        if simplex:
            kkt = torch.zeros(n + 1, n + 1, dtype=dtype)
            kkt[:n, :n] = q[idx][:, idx]
            kkt[:n, n] = 1.0
            kkt[n, :n] = 1.0
            rhs = torch.cat([-grad[idx], torch.zeros(1, dtype=dtype)])
            sol = _lstsq_sym(kkt, rhs)
            step_free = sol[:n]
        else:
            step_free = _lstsq_sym(q[idx][:, idx], -grad[idx]) if n else grad[idx]
        step = torch.zeros(k, dtype=dtype)
        step[idx] = step_free
        if float(step.abs().max()) <= tol * (1.0 + float(x.abs().max())):
            # Subproblem minimum: check the multipliers of the bounds held fixed.
            if simplex:
                nu = grad[idx].mean() if n else torch.zeros((), dtype=dtype)
                mult = grad - nu
            else:
                mult = grad
            mult = torch.where(fixed, mult, torch.zeros_like(mult))
            worst = int(torch.argmin(mult))
            if float(mult[worst]) >= -tol:
                return x
            fixed[worst] = False
            continue
        ratios = torch.where(
            free & (step < 0), (lower - x) / torch.where(step < 0, step, -torch.ones_like(step)),
            torch.full_like(x, float("inf")),
        )
        block = int(torch.argmin(ratios))
        alpha = min(1.0, float(ratios[block]))
        x = x + alpha * step
        if alpha < 1.0:
            x[block] = lower[block]
            fixed[block] = True
    raise SolverError(
        f"active-set QP did not converge in {max_iter} iterations (K={k}); the Gramian may be "
        f"badly conditioned — pass a larger max_iter or check the task gradients"
    )


def min_norm_simplex(gram: Tensor, tol: float = QP_TOL) -> Tensor:
    """MGDA: ``argmin_{w ∈ Δ} wᵀ G w`` (min-norm point of the convex hull of the rows).

    ``gram`` should be trace-normalised. Optimality (KKT): ``(G w)ₖ = wᵀGw`` where ``wₖ > 0``
    and ``(G w)ₖ ≥ wᵀGw`` elsewhere, to ``tol``.
    """
    k = gram.shape[0]
    zeros = torch.zeros(k, dtype=torch.float64)
    return solve_box_qp(gram, zeros, zeros, simplex=True, tol=tol)


def project_dual_cone(gram: Tensor, u: Tensor, tol: float = QP_TOL) -> Tensor:
    """Weights ``v`` with ``Jᵀv`` the projection of ``Jᵀu`` onto ``{x : J x ≥ 0}``.

    Dual form (Quinton & Rey 2024, Prop. 1): ``min vᵀ G v`` s.t. ``v ≥ u``.
    """
    k = gram.shape[0]
    return solve_box_qp(gram, torch.zeros(k, dtype=torch.float64), u.to(torch.float64),
                        tol=tol)


def cagrad_dual(gram: Tensor, c: float, tol: float = 1e-12, max_iter: int = 200) -> Tensor:
    """CAGrad's dual weights ``w ∈ Δ`` (Liu et al. 2021, eq. 4).

    ``min_{w∈Δ} F(w) = g_wᵀ g₀ + r ‖g_w‖`` with ``g₀ = Jᵀ1/K``, ``g_w = Jᵀw``,
    ``r = c‖g₀‖``. Writing ``‖g_w‖ = min_ρ>0 (‖g_w‖²/ρ + ρ)/2`` makes
    ``φ(ρ) = min_w wᵀG1/K + (r/2)(wᵀGw/ρ + ρ)`` convex in ``ρ`` (quadratic over linear), with
    ``φ'(ρ) = (r/2)(1 − ‖g_{w(ρ)}‖²/ρ²)``. The root ``ρ* = ‖g_w*‖`` is bracketed and found by
    Illinois regula falsi with bisection safeguard, each evaluation one simplex QP
    (warm-started). Requires ``0 < c < 1``. If ``‖g_w*‖ < 1e-12 max‖gₖ‖`` (a zero-norm
    combination is optimal, e.g. a zero task gradient) the returned ``w`` has ``g_w ≈ 0``.
    """
    k = gram.shape[0]
    mean = torch.full((k,), 1.0 / k, dtype=torch.float64)
    lin = gram @ mean
    g0_sq = float(mean @ lin)
    r = c * max(g0_sq, 0.0) ** 0.5
    zeros = torch.zeros(k, dtype=torch.float64)
    state: dict[str, Tensor] = {"x": mean.clone()}

    def solve(rho: float) -> tuple[Tensor, float]:
        w = solve_box_qp(gram * (r / rho), lin, zeros, simplex=True, x0=state["x"], tol=tol)
        state["x"] = w
        return w, float(w @ gram @ w)

    def f(rho: float) -> tuple[float, Tensor]:
        w, q = solve(rho)
        return 1.0 - q / (rho * rho), w

    hi = float(torch.diagonal(gram).max()) ** 0.5
    if hi == 0.0 or r == 0.0:
        return mean
    f_hi, w_hi = f(hi)
    if f_hi <= 0.0:
        return w_hi
    lo = hi
    while True:
        lo *= 0.25
        f_lo, w_lo = f(lo)
        if f_lo <= 0.0:
            break
        if lo < 1e-12 * hi:
            # ‖g_w*‖ < 1e-12 ‖g‖_max: a zero-norm combination is optimal (e.g. a zero row).
            return w_lo
    if f_lo == 0.0:
        return w_lo
    side = 0
    for _ in range(max_iter):
        rho = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        if not lo < rho < hi:
            rho = 0.5 * (lo + hi)
        f_mid, w_mid = f(rho)
        if abs(f_mid) <= tol or (hi - lo) <= tol * hi:
            return w_mid
        if f_mid < 0.0:
            lo, f_lo = rho, f_mid
            if side == -1:
                f_hi *= 0.5
            side = -1
        else:
            hi, f_hi = rho, f_mid
            if side == 1:
                f_lo *= 0.5
            side = 1
    raise SolverError(f"CAGrad dual did not converge in {max_iter} iterations")


def nash_bargaining(
    gram: Tensor, alpha0: Tensor | None = None, tol: float = 1e-10, max_iter: int = 100
) -> Tensor:
    """Nash-MTL: the ``α > 0`` with ``(G α)ᵢ = 1/αᵢ`` (Navon et al. 2022, Thm 5.1).

    Damped Newton on ``f(α) = ½ αᵀGα − Σ log αᵢ`` (gradient ``Gα − 1/α``, Hessian
    ``G + diag(1/α²)``), backtracking to stay in ``α > 0`` and decrease ``f``. Stops when
    ``max |αᵢ (Gα)ᵢ − 1| ≤ tol``. A zero gradient gets ``αᵢ = 0`` and the game is solved
    among the others. Raises :class:`SolverError` if it does not converge, e.g. when a
    non-negative combination of non-zero gradients vanishes (then no solution exists).
    """
    k = gram.shape[0]
    diag = torch.diagonal(gram)
    active = diag > 1e-24 * diag.sum().clamp_min(1e-300)
    if not bool(active.all()):
        # A zero gradient can be neither helped nor hurt: it leaves the game (weight 0).
        alpha = torch.zeros(k, dtype=torch.float64)
        if bool(active.any()):
            idx = torch.nonzero(active).flatten()
            sub0 = None if alpha0 is None or alpha0.numel() != k else alpha0[idx]
            alpha[idx] = nash_bargaining(gram[idx][:, idx], sub0, tol, max_iter)
        return alpha
    if alpha0 is None or alpha0.numel() != k or not bool(torch.all(alpha0 > 0)):
        alpha = diag.rsqrt()
    else:
        alpha = alpha0.to(torch.float64).clone()

    def objective(a: Tensor) -> float:
        return float(0.5 * a @ gram @ a - torch.log(a).sum())

    value = objective(alpha)
    for _ in range(max_iter):
        ga = gram @ alpha
        residual = alpha * ga - 1.0
        if float(residual.abs().max()) <= tol:
            return alpha
        grad = ga - 1.0 / alpha
        hess = gram + torch.diag(1.0 / (alpha * alpha))
        step, info = torch.linalg.solve_ex(hess, -grad)
        if int(info) != 0 or float(alpha.max()) > 1e12 or not bool(torch.isfinite(step).all()):
            break  # α diverges: a non-negative combination of the gradients vanishes
        t = 1.0
        neg = step < 0
        if bool(neg.any()):
            t = min(1.0, 0.99 * float((-alpha[neg] / step[neg]).min()))
        slope = float(grad @ step)
        res_max = float(residual.abs().max())
        while True:
            cand = alpha + t * step
            cand_value = objective(cand)
            # Near the optimum f changes by O(residual²), below float64 resolution of f, so
            # Armijo alone stalls there; a step that lowers the residual is accepted too.
            cand_res = float((cand * (gram @ cand) - 1.0).abs().max())
            if cand_value <= value + 1e-4 * t * slope or cand_res < res_max or t < 1e-12:
                break
            t *= 0.5
        if t < 1e-12:
            break
        alpha, value = cand, cand_value
    raise SolverError(
        f"Nash-MTL bargaining solve did not converge in {max_iter} Newton steps (K={k}); "
        f"a non-negative combination of the task gradients is (nearly) zero, so G α = 1/α "
        f"has no solution"
    )
