"""K-dimensional solvers shared by the Gramian-based balancers (torch only, float64).

All solvers work on a ``[K, K]`` Gramian ``G = J Jᵀ`` (symmetric positive semi-definite) that
the caller has normalised by its trace, so the tolerances below are absolute on a problem whose
largest entry is at most 1. They run on the CPU (the problems are tiny and branchy) and raise
:class:`SolverError` when they do not converge: they never fall back to uniform weights.

* :func:`solve_box_qp` — ``min ½ xᵀQx + cᵀx`` s.t. ``x ≥ lower`` and optionally ``Σ x = 1``:
  a primal active-set method (Nocedal & Wright, *Numerical Optimization*, Alg. 16.3). Each
  equality-constrained subproblem is solved in the least-norm sense (pseudo-inverse), which is
  exact when ``c`` lies in the range of ``Q`` — true for every use here.
* :func:`project_simplex` — Euclidean projection onto the simplex (MoDo, MoCo, SDMGrad).
* :func:`min_norm_simplex` — MGDA's min-norm point of the convex hull of the rows.
* :func:`project_dual_cone` — UPGrad/DualProj: ``min vᵀGv`` s.t. ``v ≥ u``, whose solution
  ``Jᵀv`` is the projection of ``Jᵀu`` onto the dual cone ``{x : Jx ≥ 0}``.
* :func:`cagrad_dual` — CAGrad's dual ``min_{w∈Δ} wᵀG u + r‖Jᵀw‖`` by a safeguarded
  one-dimensional root search over an auxiliary norm variable, each point one simplex QP,
  the next point the exact root on the current support.
* :func:`nash_bargaining` — Nash-MTL's ``G α = 1/α``, ``α > 0`` by damped Newton on the
  strictly convex ``½ αᵀGα − Σ log αᵢ``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._boxqp import is_well_conditioned, solve_box_qp_batched

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


def project_simplex(v: Tensor) -> Tensor:
    """Euclidean projection of ``v`` ``[K]`` onto the probability simplex (sort-based, exact).

    ``argmin_{w ≥ 0, Σw = 1} ‖w − v‖``: ``w = max(v − θ, 0)`` with ``θ`` from the sorted
    cumulative sums (Held, Wolfe & Crowder 1974; Duchi et al. 2008).
    """
    k = v.shape[0]
    u, _ = torch.sort(v, descending=True)
    css = torch.cumsum(u, dim=0) - 1.0
    idx = torch.arange(1, k + 1, dtype=v.dtype, device=v.device)
    # u_j > css_j / j holds exactly on a prefix j ≤ ρ (cond[0] always): count it, no host sync.
    rho = (u * idx > css).sum(dim=0, keepdim=True)
    theta = css.gather(0, rho - 1) / rho.to(v.dtype)
    return (v - theta).clamp_min(0)


def solve_box_qp(
    q: Tensor,
    c: Tensor,
    lower: Tensor,
    simplex: bool = False,
    x0: Tensor | None = None,
    tol: float = QP_TOL,
    max_iter: int | None = None,
    well_conditioned: bool | None = None,
) -> Tensor:
    """Minimise ``½ xᵀ q x + cᵀx`` subject to ``x ≥ lower`` (and ``Σ x = 1`` if ``simplex``).

    Primal active-set method: the working set holds the indices fixed at their bound; each
    iteration solves the subproblem on the free indices (least-norm), steps to the first
    blocking bound, or, at a subproblem minimum, releases the bound with the most negative
    multiplier. Terminates in finitely many steps; raises :class:`SolverError` after
    ``max_iter`` (default ``50 + 20 K``) iterations. ``q`` must be symmetric PSD with ``c`` in
    its range (true for all callers). ``x0`` must be feasible.

    ``c``, ``lower`` (and ``x0``) may be ``[K]`` or ``[B, K]``: ``B`` problems sharing ``q``
    are solved together (see :mod:`gradbalance.balancers._boxqp`), returning ``[B, K]``.
    """
    k = q.shape[0]
    single = c.dim() == 1
    c2 = c.reshape(-1, k)
    lower2 = lower.reshape(-1, k).expand_as(c2)
    start = None if x0 is None else x0.reshape(-1, k)
    x = solve_box_qp_batched(q, c2, lower2, simplex, start, tol, max_iter, well_conditioned)
    if x is None:
        raise SolverError(
            f"active-set QP did not converge in {max_iter or 50 + 20 * k} iterations (K={k}); "
            f"the Gramian may be badly conditioned — pass a larger max_iter or check the task "
            f"gradients"
        )
    return x[0] if single else x


def min_norm_simplex(gram: Tensor, tol: float = QP_TOL) -> Tensor:
    """MGDA: ``argmin_{w ∈ Δ} wᵀ G w`` (min-norm point of the convex hull of the rows).

    ``gram`` should be trace-normalised. Optimality (KKT): ``(G w)ₖ = wᵀGw`` where ``wₖ > 0``
    and ``(G w)ₖ ≥ wᵀGw`` elsewhere, to ``tol``. For ``K = 2`` the closed form of Sener &
    Koltun (2018, Alg. 1): ``w₁ = clip((G₂₂ − G₁₂) / (G₁₁ − 2G₁₂ + G₂₂), 0, 1)``.
    """
    k = gram.shape[0]
    if k == 2:
        return min_norm_two(gram)
    zeros = torch.zeros(k, dtype=torch.float64)
    return solve_box_qp(gram, zeros, zeros, simplex=True, tol=tol)


def min_norm_two(gram: Tensor) -> Tensor:
    """Closed-form min-norm point of two rows: ``[γ, 1 − γ]`` (γ = ½ for equal rows)."""
    g11, g12, g22 = gram[0, 0], gram[0, 1], gram[1, 1]
    diff = g11 - 2 * g12 + g22
    safe = torch.where(diff > 0, diff, torch.ones_like(diff))
    gamma = torch.where(diff > 0, ((g22 - g12) / safe).clamp(0.0, 1.0), 0.5)
    return torch.stack([gamma, 1.0 - gamma]).to(torch.float64)


def project_dual_cone(gram: Tensor, u: Tensor, tol: float = QP_TOL) -> Tensor:
    """Weights ``v`` with ``Jᵀv`` the projection of ``Jᵀu`` onto ``{x : J x ≥ 0}``.

    Dual form (Quinton & Rey 2024, Prop. 1): ``min vᵀ G v`` s.t. ``v ≥ u``. ``u`` may be
    ``[K]`` or ``[B, K]`` (``B`` projections solved together, result ``[B, K]``).
    """
    u = u.to(torch.float64)
    return solve_box_qp(gram, torch.zeros_like(u), u, tol=tol)


def _support_root(gram: Tensor, lin: Tensor, r: float, w: Tensor) -> float | None:
    """``ρ*`` of CAGrad's norm equation if the support of ``w`` stays optimal, else None.

    On a fixed support ``F`` (``G_FF`` positive definite) the simplex QP of
    :func:`cagrad_dual` has the solution ``w(ρ) = w₀ + ρ w₁`` with ``w₀ = y_a/a``,
    ``w₁ = (β y_a/a − y_b)/r``, ``y_a = G_FF⁻¹1``, ``y_b = G_FF⁻¹ lin_F``, ``a = 1ᵀy_a``,
    ``β = 1ᵀy_b``; since ``G_FF w₀ ∝ 1`` and ``1ᵀw₁ = 0``,
    ``‖g_{w(ρ)}‖² = 1/a + C ρ²`` with ``C = w₁ᵀG w₁``, and ``‖g_w‖ = ρ`` gives
    ``ρ* = (a (1 − C))^{-1/2}`` (no root on this support when ``C ≥ 1``).
    """
    idx = torch.nonzero(w > 0).flatten()
    sub = gram[idx][:, idx]
    chol, info = torch.linalg.cholesky_ex(sub)
    if int(info) != 0:
        return None
    ones = torch.ones(idx.numel(), dtype=torch.float64)
    y = torch.cholesky_solve(torch.stack([ones, lin[idx]], dim=1), chol)
    a, beta = float(y[:, 0].sum()), float(y[:, 1].sum())
    if not a > 0.0:
        return None
    w1 = (beta / a * y[:, 0] - y[:, 1]) / r
    curv = float(w1 @ sub @ w1)
    if not curv < 1.0:
        return None
    return (a * (1.0 - curv)) ** -0.5


def cagrad_dual(gram: Tensor, c: float, tol: float = 1e-12, max_iter: int = 200) -> Tensor:
    """CAGrad's dual weights ``w ∈ Δ`` (Liu et al. 2021, eq. 4).

    ``min_{w∈Δ} F(w) = g_wᵀ g₀ + r ‖g_w‖`` with ``g₀ = Jᵀ1/K``, ``g_w = Jᵀw``,
    ``r = c‖g₀‖``. Writing ``‖g_w‖ = min_ρ>0 (‖g_w‖²/ρ + ρ)/2`` makes
    ``φ(ρ) = min_w wᵀG1/K + (r/2)(wᵀGw/ρ + ρ)`` convex in ``ρ`` (quadratic over linear), with
    ``φ'(ρ) = (r/2)(1 − ‖g_{w(ρ)}‖²/ρ²)``; its root ``ρ* = ‖g_w*‖`` gives the optimum. Each
    evaluation is one simplex QP (warm-started). The next point is the exact root for the
    current support of ``w`` (see :func:`_support_root`: one step when the support is right,
    typically 2–3 QPs per call), safeguarded by a bracket and Illinois regula falsi /
    bisection. Requires ``0 < c < 1``. If ``‖g_w*‖ < 1e-12 max‖gₖ‖`` (a zero-norm
    combination is optimal, e.g. a zero task gradient) the returned ``w`` has ``g_w ≈ 0``.
    """
    k = gram.shape[0]
    mean = torch.full((k,), 1.0 / k, dtype=torch.float64)
    lin = gram @ mean
    g0_sq = float(mean @ lin)
    r = c * max(g0_sq, 0.0) ** 0.5
    zeros = torch.zeros(k, dtype=torch.float64)
    hi = float(torch.diagonal(gram).max()) ** 0.5
    if hi == 0.0 or r == 0.0:
        return mean
    well = is_well_conditioned(gram)
    state: dict[str, Tensor] = {"x": mean.clone()}

    def f(rho: float) -> tuple[float, Tensor]:
        w = solve_box_qp(gram * (r / rho), lin, zeros, simplex=True, x0=state["x"], tol=tol,
                         well_conditioned=well)
        state["x"] = w
        return 1.0 - float(w @ gram @ w) / (rho * rho), w

    lo, f_lo = 0.0, -float("inf")  # φ' < 0 near ρ = 0 unless g_w* = 0
    f_hi, w_hi = f(hi)
    if f_hi <= 0.0:
        return w_hi
    rho, w_mid, side = hi, w_hi, 0
    for _ in range(max_iter):
        guess = _support_root(gram, lin, r, w_mid)
        if guess is not None and lo < guess < hi and guess != rho:
            rho = guess
        elif lo > 0.0:
            rho = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
            if not lo < rho < hi:
                rho = 0.5 * (lo + hi)
        else:
            rho = 0.25 * hi
            if rho < 1e-12 * float(torch.diagonal(gram).max()) ** 0.5:
                # ‖g_w*‖ < 1e-12 ‖g‖_max: a zero-norm combination is optimal (e.g. a zero row).
                return w_mid
        f_mid, w_mid = f(rho)
        if abs(f_mid) <= tol or (lo > 0.0 and (hi - lo) <= tol * hi):
            return w_mid
        if f_mid < 0.0:
            lo, f_lo = rho, f_mid
            if side == -1:
                f_hi *= 0.5
            side = -1
        else:
            hi, f_hi = rho, f_mid
            if side == 1 and lo > 0.0:
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
    # Best multiple of the start: f(sα) is minimal at s² αᵀGα = K (Σ αᵢ(Gα)ᵢ = K holds at the
    # solution), which removes the scale error of a cold or stale start in one step.
    alpha = alpha * (k / (alpha @ gram @ alpha).clamp_min(1e-300)).sqrt()

    def objective(a: Tensor) -> Tensor:
        return 0.5 * a @ gram @ a - torch.log(a).sum()

    value = float(objective(alpha))
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    for _ in range(max_iter):
        ga = gram @ alpha
        residual = alpha * ga - 1.0
        grad = ga - 1.0 / alpha
        hess = gram + torch.diag(1.0 / (alpha * alpha))
        step, info = torch.linalg.solve_ex(hess, -grad)
        ratio = torch.where(step < 0, -alpha / step, inf).min()
        # One host sync for every scalar the iteration needs.
        res_max, bad, a_max, ratio_v, slope = torch.stack([
            residual.abs().max(), (info != 0).to(torch.float64) + (~torch.isfinite(step)).sum(),
            alpha.max(), ratio, grad @ step]).tolist()
        if res_max <= tol:
            return alpha
        if bad != 0 or a_max > 1e12:
            break  # α diverges: a non-negative combination of the gradients vanishes
        t = min(1.0, 0.99 * ratio_v)
        while True:
            cand = alpha + t * step
            cand_value, cand_res = torch.stack([
                objective(cand), (cand * (gram @ cand) - 1.0).abs().max()]).tolist()
            # Near the optimum f changes by O(residual²), below float64 resolution of f, so
            # Armijo alone stalls there; a step that lowers the residual is accepted too.
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
