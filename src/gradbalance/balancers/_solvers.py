"""K-dimensional solvers shared by the Gramian-based balancers (torch only, float64).

All solvers work on a ``[K, K]`` Gramian ``G = J Jᵀ`` (symmetric positive semi-definite, or
so up to rounding) that the caller has normalised by its trace, so the tolerances below are
absolute on a problem whose largest entry is at most 1. They run on the CPU (the problems
are tiny and branchy) and never fall back to uniform weights. The QPs and CAGrad's dual
return the method's answer for every such Gramian — colinear rows, ``K > P``, zero rows,
float32 rounding included — at a cost bounded whatever the input; Nash-MTL's bargaining,
where its equation has no solution, warns and solves it with a ridge (or raises
:class:`SolverError` on request).

* :func:`solve_box_qp` — ``min ½ xᵀQx + cᵀx`` s.t. ``x ≥ lower`` and optionally ``Σ x = 1``,
  for one or ``B`` problems sharing ``Q``: block principal pivoting when ``Q`` is well
  conditioned, least squares on a factor of ``Q`` (Lawson–Hanson NNLS, with a FISTA
  fallback) otherwise and for anything left open (see :mod:`gradbalance.balancers._boxqp`).
  ``c`` must lie in the range of ``Q`` — true for every use here.
* :func:`project_simplex` — Euclidean projection onto the simplex (MoDo, MoCo, SDMGrad).
* :func:`min_norm_simplex` — MGDA's min-norm point of the convex hull of the rows (closed
  form for ``K = 2``; on the cosine matrix where the norms spread, :func:`min_norm_cosine`).
* :func:`project_dual_cone` — UPGrad/DualProj: ``min vᵀGv`` s.t. ``v ≥ u``, whose solution
  ``Jᵀv`` is the projection of ``Jᵀu`` onto the dual cone ``{x : Jx ≥ 0}`` (batched; closed
  form for ``K = 2``).
* :func:`cagrad_dual` — CAGrad's dual ``min_{w∈Δ} wᵀG u + r‖Jᵀw‖`` by a safeguarded
  one-dimensional root search over an auxiliary norm variable, each point one simplex QP,
  the next point the exact root on the current support.
* :func:`fair_newton` — ``G w = w^{-p}``, ``w > 0`` by damped Newton on the strictly convex
  ``½ wᵀGw − Σ φ(wᵢ)``, ``φ' = w^{-p}``: Nash-MTL's bargaining (``p = 1``,
  :func:`nash_bargaining`) and FairGrad's α-fair weights (``p = 1/α``).

Accuracy: a Gramian fixes ``‖Jᵀv‖² = vᵀGv`` only to its own rounding, so where ``wᵀJ``
cancels (a dual cone ``{0}``, ``0`` in the convex hull) any method working from ``G`` alone
gives the update to about ``√(K eps tr G) ‖w‖₁``; the optimality conditions on ``G`` hold to
float64 rounding.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor

from ._boxqp import (
    CG_MIN_SIZE,
    CHOLESKY_MAX_COND,
    INTERIOR_MIN_COLUMNS,
    ROUNDING_MULTIPLE,
    CosineSpectrum,
    certified_inverse,
    cosine_spectrum,
    eigen_factor,
    factored_box_qp,
    is_well_conditioned,
    min_norm_ls,
    singular_spectrum,
    solve_box_qp_batched,
    solve_single_kept,
)
from ._cagrad_root import cagrad_root, is_cagrad_kkt, support_root
from ._cagrad_scaled import scaled_cagrad
from ._cholesky import BLOCKED_MIN_SIZE, BlockFactors, Factor, cholesky_ex, cholesky_solve
from ._cone import scaled_projection
from ._min_norm_dual import lifted_cosine, lifted_min_norm, min_norm_dual
from ._min_norm_groups import Collapse, collapse, grouped_min_norm
from ._precond import symmetrized

__all__ = ["SolverError"]

#: Optimality tolerance of the active-set QP (on a trace-normalised Gramian).
QP_TOL = 1e-12
#: Steps without progress after which :func:`fair_newton` stops (:class:`_Stall`), and the
#: :func:`cancellation` at which a combination counts as vanishing: below what a float64
#: Gramian resolves (its entries carry a relative rounding of about ``P eps``; float32 rows
#: leave about ``1e-7``).
STALL_STEPS = 3
CANCEL_FLOOR = 1e-12
#: A row of :func:`fair_newton`'s Gramian with ``Gᵢᵢ`` below this times the trace is a zero
#: row (weight 0): a norm below 1e-20 of the rows' scale. At ``1e-24`` rows of norms
#: ``1e-6 … 1e6`` lost their shortest one (weight 0, its equation ``wᵢ(Gw)ᵢ = 1`` off by 1,
#: no warning); the Newton steps solve such rows to 5e-11 up to 18 decades apart.
ZERO_ROW = 1e-40
#: Nash-MTL's ridge, relative to the Gramian's trace, where its bargaining equation has no
#: solution (:func:`nash_bargaining`): above the rounding of a Gramian of float32 rows (its
#: eigenvalues carry about ``1e-7 tr G``), so ``G + εI`` is positive definite.
NASH_RIDGE = 1e-6
#: The ridge's equation is solved to this residual: its weights reach ``1/√ε`` times the
#: solution's scale, and ``αᵢ (Gα)ᵢ`` carries a rounding of about ``K eps / ε`` there.
NASH_RIDGE_TOL = 1e-6
#: Largest ratio of the Gramian's diagonal entries for which MGDA's simplex QP is solved on
#: ``G`` as given (:func:`min_norm_simplex`); above it, on the cosine matrix
#: (:func:`min_norm_cosine`) where that is well conditioned. The ratio bounds ``G``'s
#: condition number from below; the cosine matrix has that of the directions alone.
MIN_NORM_PLAIN_RATIO = 1e3
_EPS = torch.finfo(torch.float64).eps
#: :func:`fair_newton`'s residual counts as solved at its own rounding only up to this: where
#: no solution exists the weights diverge along the vanishing combination and the rounding
#: grows with them (a planted vanishing combination at K = 54: rounding 400, residual 17).
FAIR_ROUNDING_MAX = 1e-6
#: :func:`fair_newton` factorises its Newton systems in float32 while the residual is above
#: ``FAIR_LOW_PRECISION_ABOVE``, from ``FAIR_LOW_PRECISION_MIN_SIZE`` tasks on, on the CPU
#: (one thread, K = 1,024: 11 ms against 18 ms): far from the solution a step only has to
#: lower ``f`` or the residual, which the float64 backtracking decides; the last steps, where
#: Newton converges quadratically, are float64's.
FAIR_LOW_PRECISION_ABOVE = 1e-2
FAIR_LOW_PRECISION_MIN_SIZE = 256


class SolverError(RuntimeError):
    """A K-dimensional problem has no solution (Nash-MTL's bargaining equation, with
    ``no_solution="raise"``); no balancer state was changed.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import NashMTL, SolverError
        >>> g = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)
        >>> try:  # opposite gradients: no α > 0 with (G α)ᵢ = 1/αᵢ
        ...     NashMTL(no_solution="raise")(g)
        ... except SolverError as err:
        ...     print(str(err).split(";")[0])
        Nash-MTL bargaining solve did not converge (K=2, residual ...)
    """


def trace_normalized(gramian: Tensor) -> tuple[Tensor, Tensor]:
    """``(G / tr G, tr G)`` on the CPU in float64; a zero Gramian is returned unchanged.

    Dividing by the trace makes every solver tolerance scale-free, so a balancer gives the
    same weights for ``G`` and ``s·G`` up to rounding (1e-8 … 1e8 scales included).
    """
    gram = gramian.detach().to(device="cpu", dtype=torch.float64)
    own = gram.data_ptr() != gramian.data_ptr()  # a copy already: worked on in place
    gram = symmetrized(gram, in_place=own)
    trace = torch.diagonal(gram).sum()
    if float(trace) > 0.0:
        return gram.div_(trace), trace
    return gram, trace


def project_simplex(v: Tensor) -> Tensor:
    """Euclidean projection of ``v`` ``[K]`` onto the probability simplex (sort-based, exact).

    ``argmin_{w ≥ 0, Σw = 1} ‖w − v‖``: ``w = max(v − θ, 0)`` with ``θ`` from the sorted
    cumulative sums (Held, Wolfe & Crowder 1974; Duchi et al. 2008), on ``v − max v`` (the
    same projection; at ``v ≈ 1e300`` the largest entry less 1 rounded to itself).
    """
    k = v.shape[0]
    u, _ = torch.sort(v, descending=True)
    v, u = v - u[0], u - u[0]  # the same projection (Σw = 1 fixes the shift); u₀ − 1 < u₀
    css = torch.cumsum(u, dim=0) - 1.0
    idx = torch.arange(1, k + 1, dtype=v.dtype, device=v.device)
    # u_j > css_j / j holds exactly on a prefix j ≤ ρ (cond[0] always): count it, no host sync.
    rho = (u * idx > css).sum(dim=0, keepdim=True).clamp_min(1)  # 0 only for NaN: NaN out
    theta = css.gather(0, rho - 1) / rho.to(v.dtype)
    return (v - theta).clamp_min(0)


def solve_box_qp(
    q: Tensor,
    c: Tensor,
    lower: Tensor,
    simplex: bool = False,
    x0: Tensor | None = None,
    tol: float = QP_TOL,
    well_conditioned: bool | None = None,
    inverse: Tensor | None = None,
) -> Tensor:
    """Minimise ``½ xᵀ q x + cᵀx`` subject to ``x ≥ lower`` (and ``Σ x = 1`` if ``simplex``).

    ``q`` must be symmetric PSD (rounding-level negative eigenvalues are dropped) with ``c``
    in its range (true for all callers); ``x0``, a feasible start, is optional. Block
    principal pivoting when ``q`` is well conditioned, least squares on a factor of ``q``
    otherwise and for whatever pivoting leaves open (see
    :mod:`gradbalance.balancers._boxqp`): an answer for every such ``q``, at a bounded cost.

    ``c``, ``lower`` (and ``x0``) may be ``[K]`` or ``[B, K]``: ``B`` problems sharing ``q``
    are solved together, returning ``[B, K]``. ``inverse``: ``q⁻¹`` where the caller has
    certified it (:func:`~._boxqp.certified_inverse`).
    """
    k = q.shape[0]
    single = c.dim() == 1
    c2 = c.reshape(-1, k)
    lower2 = lower.reshape(-1, k).expand_as(c2)
    start = None if x0 is None else x0.reshape(-1, k)
    x = solve_box_qp_batched(q, c2, lower2, simplex, start, tol, well_conditioned, inverse)
    return x[0] if single else x


def min_norm_simplex(gram: Tensor, tol: float = QP_TOL) -> Tensor:
    """MGDA: ``argmin_{w ∈ Δ} wᵀ G w`` (min-norm point of the convex hull of the rows).

    ``gram`` should be trace-normalised. Optimality (KKT): ``(G w)ₖ = wᵀGw`` where ``wₖ > 0``
    and ``(G w)ₖ ≥ wᵀGw`` elsewhere, to ``tol``. For ``K = 2`` the closed form of Sener &
    Koltun (2018, Alg. 1): ``w₁ = clip((G₂₂ − G₁₂) / (G₁₁ − 2G₁₂ + G₂₂), 0, 1)``. A diagonal
    spanning more than ``MIN_NORM_PLAIN_RATIO`` (no zero row) is solved on the cosine
    matrix (:func:`min_norm_cosine`). Otherwise a Gramian whose Cholesky factorisation fails
    goes straight to its cosine matrix's eigenvalues (:func:`~._boxqp.singular_spectrum`:
    one eigen-decomposition, not the pivoting's check too). From ``INTERIOR_MIN_COLUMNS``
    tasks on, where a float32 Gramian's rounding leaves a small null space, it is lifted
    off it (:func:`~._min_norm_dual.lifted_min_norm`), else least squares on its factor,
    which goes to the interior point (whose Newton steps cost ``O(K³)`` each on a factor of
    full rank) and is cut at ``ROUNDING_MULTIPLE`` times the most negative eigenvalue of the
    cosine matrix (:func:`~._boxqp.rounding_cut`: the rounding a float32 Gramian carries,
    about ``K/2`` positive eigenvalues of it dropped). Either answer is that of a Gramian
    within ``1 + ROUNDING_MULTIPLE`` times the given one's distance from the rows' exact
    Gramian. Rows that are positive multiples of one another within the rounding (a task
    given twice) are first collapsed to the shortest of each group
    (:func:`~._min_norm_groups.grouped_min_norm`, its answer checked on the whole Gramian).
    """
    grouped = grouped_min_norm(gram, partial(_min_norm_distinct, tol=tol))
    return grouped if grouped is not None else _min_norm_distinct(gram, tol)


def _min_norm_distinct(gram: Tensor, tol: float = QP_TOL) -> Tensor:
    """:func:`min_norm_simplex` without the collapse of parallel rows (one row: weight 1)."""
    k = gram.shape[0]
    if k == 1:
        return torch.ones(1, dtype=torch.float64)
    if k == 2:
        return min_norm_two(gram)
    rounding = ROUNDING_MULTIPLE if k >= INTERIOR_MIN_COLUMNS else 0.0
    scaled = min_norm_cosine(gram, tol, rounding)
    if scaled is not None:
        return scaled
    zeros = torch.zeros(k, dtype=torch.float64)
    spectrum = singular_spectrum(gram)
    if spectrum is None:
        return solve_box_qp(gram, zeros, zeros, simplex=True, tol=tol)
    lifted = lifted_min_norm(spectrum, tol) if rounding else None
    if lifted is not None:
        return lifted
    factor, _ = eigen_factor(gram, rounding, spectrum)
    return factored_box_qp(factor, zeros, zeros, True, None, tol)


def min_norm_cosine(gram: Tensor, tol: float = QP_TOL, rounding: float = 0.0) -> Tensor | None:
    """MGDA's ``argmin_{w ∈ Δ} wᵀGw`` on the cosine matrix ``C = D⁻¹GD⁻¹``
    (``D = diag(G)^{1/2}``), where the diagonal of ``G`` spans more than
    ``MIN_NORM_PLAIN_RATIO`` and no row is zero; None elsewhere.

    With ``u = Dw`` the problem is ``min uᵀCu`` over ``u ≥ 0``, ``aᵀu = 1``, ``aᵢ = 1/dᵢ``
    (scaled to a largest entry of 1): ``C`` has a unit diagonal and the conditioning of the
    directions alone whatever the norms (van der Sluis 1969), where ``G``'s tolerances and
    factor would be set by its largest rows. Where ``C`` is certified positive definite
    with condition number below ``CHOLESKY_MAX_COND`` (:func:`~._boxqp.certified_inverse`)
    its dual box QP (:func:`~._min_norm_dual.min_norm_dual`); else, with ``rounding``, the
    same on ``C`` lifted off its rounding where that applies
    (:func:`~._min_norm_dual.lifted_min_norm`), or least squares on the eigen-factor of
    ``C`` (cut at ``rounding`` times its most negative eigenvalue, :func:`~._boxqp.rounding_cut`)
    by :func:`~._boxqp.min_norm_ls` with the weights ``a``; ``w = (u/d)/Σ(u/d)``.
    ``O(K³)``: one Cholesky factorisation and inverse of ``C`` and the pivoting's, or one
    eigen-decomposition and the pivoting or Lawson–Hanson.
    """
    diag = torch.diagonal(gram)
    low, high = torch.stack(diag.aminmax()).tolist()  # one host sync
    if not (low > 0.0 and high > MIN_NORM_PLAIN_RATIO * low):
        return None
    k = gram.shape[0]
    d = diag.sqrt()
    cos = symmetrized(gram / torch.outer(d, d * k))  # trace 1: normalised as the solvers expect
    a = d.min() / d
    if certified_inverse(cos) is not None:
        u = min_norm_dual(cos, a, tol)
    else:
        spectrum = cosine_spectrum(gram)  # C's eigenvalues, G's norms: the lift's weights
        lifted = lifted_min_norm(spectrum, tol) if rounding else None
        if lifted is not None:
            return lifted
        u = min_norm_ls(eigen_factor(cos, rounding, spectrum)[0].T, None, tol, a)
    lam = u / d
    return lam / lam.sum()


def min_norm_two(gram: Tensor) -> Tensor:
    """Closed-form min-norm point of two rows: ``[γ, 1 − γ]`` (γ = ½ for equal rows)."""
    (g11, g12), (_, g22) = gram.tolist()
    diff = g11 - 2 * g12 + g22
    gamma = min(max((g22 - g12) / diff, 0.0), 1.0) if diff > 0 else 0.5
    return torch.tensor([gamma, 1.0 - gamma], dtype=torch.float64)


def project_dual_cone(gram: Tensor, u: Tensor, tol: float = QP_TOL) -> Tensor:
    """Weights ``v`` with ``Jᵀv`` the projection of ``Jᵀu`` onto ``{x : J x ≥ 0}``.

    Dual form (Quinton & Rey 2024, Prop. 1): ``min vᵀ G v`` s.t. ``v ≥ u``. ``u`` may be
    ``[K]`` or ``[B, K]`` (``B`` projections solved together, result ``[B, K]``); ``K = 2``
    has a closed form (:func:`dual_cone_two`); otherwise it is solved on the cosine matrix
    of the non-zero rows (:func:`~._cone.scaled_projection`).
    """
    u = u.to(torch.float64)
    if gram.shape[0] == 2:
        return dual_cone_two(gram, u.reshape(-1, 2)).reshape(u.shape)
    return scaled_projection(gram, u.reshape(-1, gram.shape[0]), tol, _box).reshape(u.shape)


def _box(q: Tensor, lower: Tensor, tol: float, inverse: Tensor | None = None) -> Tensor:
    """``argmin_{x ≥ lowerᵦ} ½ xᵀQx`` for each row of ``lower`` ``[B, K]`` (``inverse``:
    ``Q⁻¹``, certified by the caller)."""
    return solve_box_qp_batched(q, torch.zeros_like(lower), lower, tol=tol, inverse=inverse,
                                scaled=True)  # the cone's Q: a diagonal within the ratio


def dual_cone_two(gram: Tensor, u: Tensor) -> Tensor:
    """``K = 2``: ``argmin_{v ≥ u} vᵀGv`` for each row of ``u`` ``[B, 2]``, in closed form.

    Unless the optimum is a zero-norm ``v`` inside the feasible set, it lies on a face
    ``vᵢ = uᵢ``, where the best ``vⱼ`` is ``max(uⱼ, −uᵢGᵢⱼ/Gⱼⱼ)`` (``uⱼ`` if ``Gⱼⱼ = 0``);
    a zero-norm optimum is reached on one of the two faces too. The better face wins.
    """
    entries: list[list[float]] = gram.tolist()  # a handful of scalars: Python floats are fastest
    (g11, g12), (_, g22) = entries

    def best(ui: float, uj: float, gjj: float) -> float:
        return max(uj, -ui * g12 / gjj) if gjj > 0 else uj

    def value(v: tuple[float, float]) -> float:
        return v[0] * v[0] * g11 + 2 * v[0] * v[1] * g12 + v[1] * v[1] * g22

    rows = []
    for u1, u2 in u.tolist():
        first = (u1, best(u1, u2, g22))  # v₁ = u₁
        second = (best(u2, u1, g11), u2)  # v₂ = u₂
        rows.append(first if value(first) <= value(second) else second)
    return torch.tensor(rows, dtype=torch.float64)


def _cagrad_two(gram: Tensor, lin: Tensor, r: float) -> Tensor | None:
    """``K = 2`` dual in closed form; None for a (nearly) singular Gramian.

    ``F(w) = wᵀlin + r‖g_w‖`` is convex on the segment ``w = (t, 1 − t)``. Its stationary
    point on the whole line is the support formula of
    :func:`~._cagrad_root.support_root` with both tasks (``w = y_a/a + ρ* w₁``); inside the
    segment it is the optimum, otherwise the better end ``eₖ`` (``F = linₖ + r√Gₖₖ``) is.
    """
    (g11, g12), (_, g22) = gram.tolist()
    l1, l2 = lin.tolist()
    det = g11 * g22 - g12 * g12
    tr = g11 + g22
    if not det > 1e-10 * tr * tr:
        return None
    ya = ((g22 - g12) / det, (g11 - g12) / det)  # G⁻¹1
    yb = ((g22 * l1 - g12 * l2) / det, (g11 * l2 - g12 * l1) / det)  # G⁻¹lin
    a, beta = ya[0] + ya[1], yb[0] + yb[1]
    w1 = ((beta / a * ya[0] - yb[0]) / r, (beta / a * ya[1] - yb[1]) / r)
    curv = w1[0] * w1[0] * g11 + 2 * w1[0] * w1[1] * g12 + w1[1] * w1[1] * g22
    if a > 0 and curv < 1.0:
        rho = (a * (1.0 - curv)) ** -0.5
        t = ya[0] / a + rho * w1[0]
        if 0.0 <= t <= 1.0:
            return torch.tensor([t, 1.0 - t], dtype=torch.float64)
    first = l1 + r * g11**0.5 <= l2 + r * g22**0.5
    return torch.tensor([1.0, 0.0] if first else [0.0, 1.0], dtype=torch.float64)


def cagrad_dual(gram: Tensor, c: float, tol: float = 1e-12, max_iter: int = 200,
                factor: Tensor | None = None, lifted: Tensor | None = None,
                rounding: float = 0.0) -> Tensor:
    """CAGrad's dual weights ``w ∈ Δ`` (Liu et al. 2021, eq. 4).

    ``min_{w∈Δ} F(w) = g_wᵀ g₀ + r ‖g_w‖`` with ``g₀ = Jᵀ1/K``, ``g_w = Jᵀw``,
    ``r = c‖g₀‖``. Writing ``‖g_w‖ = min_ρ>0 (‖g_w‖²/ρ + ρ)/2`` makes
    ``φ(ρ) = min_w wᵀG1/K + (r/2)(wᵀGw/ρ + ρ)`` convex in ``ρ`` (quadratic over linear), with
    ``φ'(ρ) = (r/2)(1 − ‖g_{w(ρ)}‖²/ρ²)``; its root ``ρ* = ‖g_w*‖`` gives the optimum. Each
    evaluation is one simplex QP (warm-started). The next point is the exact root for the
    current support of ``w`` (see :func:`~._cagrad_root.support_root`: one step when the
    support is right, typically 2–3 QPs per call), safeguarded by a bracket and Illinois
    regula falsi / bisection; ``K = 2`` has a closed form (:func:`_cagrad_two`). Requires
    ``0 < c < 1``.
    If ``‖g_w*‖ < 1e-12 max‖gₖ‖`` (a zero-norm combination is optimal, e.g. a zero task
    gradient) the returned ``w`` has ``g_w ≈ 0``. Rows that are copies of one another within
    the rounding (:func:`~._min_norm_groups.collapse`: ``F`` reads ``w`` only through
    ``g_w``) are solved as one row with their share of ``g₀``, the weight split equally;
    so are longer multiples (:func:`_grouped_cagrad`), where the answer meets the KKT
    conditions on the whole Gramian (:func:`_grouped_kkt_holds`: each row to ``tol`` plus
    its share of the grouping's deviation). ``lifted``: for a singular ``G`` given with its
    exact ``factor``, ``G + εD²`` (known to have condition number below
    ``CHOLESKY_MAX_COND``), tried first on the search's singular path
    (:func:`_lifted_cagrad`).
    """
    k = gram.shape[0]
    mean = torch.full((k,), 1.0 / k, dtype=torch.float64)
    grouped = _grouped_cagrad(gram, mean, c, tol, max_iter, rounding)
    if grouped is not None:
        return grouped
    scaled = scaled_cagrad(gram, mean, c, tol, max_iter, factor)
    return scaled if scaled is not None else _cagrad_search(gram, mean, c, tol, max_iter,
                                                            factor, lifted)


def _grouped_cagrad(gram: Tensor, mean: Tensor, c: float, tol: float,
                    max_iter: int, rounding: float = 0.0) -> Tensor | None:
    """:func:`cagrad_dual` with each one-signed group of parallel rows kept as one side of
    it, its shortest members or its longest (:func:`~._min_norm_groups.collapse`); None
    where there are no groups or neither side's answer meets the KKT conditions on ``gram``.

    ``F`` reads ``w`` through ``g_w`` only, and at the optimum the gradient ``d = g₀ + r
    ĝ_w`` gives every row ``gⱼᵀd ≥ m = F(w*)``, with equality on the support. A group's rows
    are ``sⱼu`` (``sⱼ > 0``): where ``m > 0`` a row in the support has ``uᵀd > 0``, so its
    shortest members are the ones at ``m`` and the longer ones above it; where ``m < 0`` the
    longest. So one side answers for every group: tried first the longest where some task
    alone has ``F(eⱼ) = linⱼ + r‖gⱼ‖ < 0`` (then ``m < 0``), else the shortest, then the
    other. The reduced problem keeps ``g₀``: each kept row's share of the mean is its group's
    summed length over its own (:meth:`~._min_norm_groups.Collapse.lengths`). ``rounding``:
    the rounding removed from ``gram`` (its kept spectrum's cut), within which its rows are
    still parallel (:func:`~._parallel_groups.find_groups`)."""
    groups = collapse(gram, rounding=rounding)
    if groups is None:
        return None
    k = gram.shape[0]
    lin = gram @ mean
    r = c * max(float(mean @ lin), 0.0) ** 0.5
    other = groups.other_side()  # None: every group's members equally long (copies)
    negative = bool((lin + r * groups.d).min() < 0.0)  # then the longest first
    for side in (other, groups) if negative else (groups, other):
        if side is None:
            continue
        kept = gram[side.kept][:, side.kept]
        share = side.lengths() / k
        reduced = scaled_cagrad(kept, share, c, tol, max_iter)  # norms decades apart
        w = side.spread(_cagrad_search(kept, share, c, tol, max_iter)
                        if reduced is None else reduced)
        rho = max(float(w @ gram @ w), 0.0) ** 0.5
        if rho > 0.0 and _grouped_kkt_holds(gram, lin, r, rho, w, tol, side):
            return w
    return None


def _grouped_kkt_holds(gram: Tensor, lin: Tensor, r: float, rho: float, w: Tensor,
                       tol: float, side: Collapse) -> bool:
    """:func:`~._cagrad_root.is_cagrad_kkt` for a collapsed answer, each row's gradient
    ``linⱼ + (r/ρ)(Gw)ⱼ`` allowed its own share of the grouping: the reduced problem is exact
    on a Gramian within ``δ dⱼdₖ`` of ``G`` (``δ`` the cosines' deviation), which moves
    ``linⱼ`` by at most ``δ dⱼ d̄`` (``d̄`` the mean norm) and ``(Gw)ⱼ`` by ``δ dⱼ s``
    (``s = dᵀw``); so ``bⱼ = 2δ dⱼ (d̄ + (r/ρ) s)`` plus ``tol (1 + max |grad|)``, and the
    optimality conditions hold where some level ``ν`` has ``|gradⱼ − ν| ≤ bⱼ`` on the
    support and ``gradⱼ ≥ ν − bⱼ`` off it. A uniform ``δ`` would let the gradients of rows a
    billionth the longest's (a float32 Gramian, ``δ ≈ 1e-6``) miss by a thousand times their
    size."""
    grad = lin + (r / rho) * (gram @ w)
    d = side.d
    b = (2.0 * side.delta) * d * (d.mean() + (r / rho) * (d @ w)) + tol * (
        1.0 + grad.abs().max())
    support = w > 0
    if not bool(support.any()) or not bool((w >= 0).all()):
        return False
    level = (grad - b)[support].max()
    ok = (level <= (grad + b)[support].min()) & ((grad + b)[~support] >= level).all()
    return bool(ok)


def _cagrad_search(gram: Tensor, mean: Tensor, c: float, tol: float, max_iter: int,
                   factor: Tensor | None = None, lifted: Tensor | None = None,
                   well_conditioned: bool = False) -> Tensor:
    """:func:`cagrad_dual` on ``gram`` with ``g₀ = Jᵀmean`` (``mean``: ``1/K`` each, or a
    collapsed group's count over ``K``: its copies' share of the average).
    ``well_conditioned``: ``gram`` known positive definite with condition number below
    ``CHOLESKY_MAX_COND`` (not checked again)."""
    k = gram.shape[0]
    lin = gram @ mean
    g0_sq = float(mean @ lin)
    r = c * max(g0_sq, 0.0) ** 0.5
    hi = float(torch.diagonal(gram).max()) ** 0.5
    if hi == 0.0 or r == 0.0 or k == 1:
        return mean
    if k == 2:
        two = _cagrad_two(gram, lin, r)
        if two is not None:
            return two
    # Every task in the support: often right, then no QP at all.
    blocks = BlockFactors(gram)  # each support factorised once (its QP, root and next QP)
    full = support_root(gram, lin, r, torch.ones(k, dtype=torch.bool), blocks)
    if full is not None and is_cagrad_kkt(gram, lin, r, full[0], full[1], tol):
        return full[1]
    if lifted is not None:
        exact = _lifted_cagrad(gram, mean, c, tol, max_iter, lifted, blocks, lin, r)
        if exact is not None:
            return exact
    used, factor = (gram, None) if well_conditioned else _cagrad_problem(gram, blocks, factor)
    if used is not gram:  # the search on G' or LLᵀ throughout: one consistent problem
        gram = used
        lin = gram @ mean
        r = c * max(float(mean @ lin), 0.0) ** 0.5
        hi = float(torch.diagonal(gram).max()) ** 0.5
        blocks = BlockFactors(gram)
    qp = _cagrad_qp(gram, factor, lin, r, tol, blocks)
    state: dict[str, Tensor | None] = {"x": None}  # the first QP starts cold

    zero_sq = 1e-24 * hi * hi  # ‖g_w‖² below this counts as a zero-norm combination

    def f(rho: float) -> tuple[float, Tensor]:
        """``(1 − ‖g_w‖²/ρ², w(ρ))``; NaN when ``g_w = 0``."""
        w = qp(rho, state["x"])
        state["x"] = w
        norm_sq = float(w @ gram @ w)
        return (float("nan") if norm_sq <= zero_sq else 1.0 - norm_sq / (rho * rho)), w

    return cagrad_root(gram, lin, r, hi, f, tol, max_iter, blocks)


def _lifted_cagrad(gram: Tensor, mean: Tensor, c: float, tol: float, max_iter: int,
                   lifted: Tensor, blocks: BlockFactors, lin: Tensor,
                   r: float) -> Tensor | None:
    """The dual weights on a singular ``G`` (a cleaned Gramian, :func:`~._denoise.cleaned`)
    from its lift ``G + εD²`` (:meth:`~._denoise.KeptSpectrum.lift`, positive definite: the
    root search's QPs on direct factorisations): the lifted answer's support solved on ``G``
    itself (:func:`~._cagrad_root.support_root`, one Cholesky factorisation of ``G_SS``),
    kept where it meets the KKT conditions on ``G`` (:func:`~._cagrad_root.is_cagrad_kkt`,
    to ``tol``): ``G``'s exact answer. None where the support fails (an optimum with
    ``g_w = 0``, whose support holds a null direction of ``G``): then the least squares on
    ``G``'s factor, whose interior point costs ``O(K³)`` a Newton step (K = 1,024, rows of
    rank ``K − 1``: CAGrad 5.8× → 2.3× the Gramian). ``blocks``, ``lin = G·mean``, ``r``:
    the search's on ``G``."""
    w = _cagrad_search(lifted, mean, c, tol, max_iter, well_conditioned=True)
    polished = support_root(gram, lin, r, w > 0.0, blocks)
    if polished is not None and is_cagrad_kkt(gram, lin, r, polished[0], polished[1], tol):
        return polished[1]
    return None


def _cagrad_problem(gram: Tensor, blocks: BlockFactors,
                    given: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """``(G, L)``: the Gramian :func:`cagrad_dual`'s root search runs on and, where it is
    not well conditioned, its factor (``G ≈ LLᵀ``, :func:`~._boxqp.eigen_factor`), else None.
    A badly conditioned ``G`` (:func:`_surely_ill`, else
    :func:`~._boxqp.is_well_conditioned`) is, from ``INTERIOR_MIN_COLUMNS`` tasks on,
    lifted off its rounding where that applies (:func:`_cagrad_lifted`: ``(G', None)``),
    else factored once; from ``INTERIOR_MIN_COLUMNS`` tasks the factor is cut at
    ``ROUNDING_MULTIPLE`` times the cosine matrix's most negative eigenvalue, as MGDA's (its
    rounding-level eigenvalues would each be a dimension of the interior point's Newton
    steps), and the search runs on ``LLᵀ``. ``G'`` and ``LLᵀ`` are within
    ``1 + ROUNDING_MULTIPLE`` times the given Gramian's distance from the rows' exact one.
    ``blocks``: ``G``'s kept factors (the whole one among them).
    ``given``: ``G``'s exact factor (the cleaned Gramian's, :func:`~._denoise.cleaned`),
    used as found on the singular path without another eigen-decomposition."""
    if given is not None:
        return (given @ given.T if gram.shape[0] >= INTERIOR_MIN_COLUMNS else gram), given
    k = gram.shape[0]
    whole = blocks.factor(list(range(k)))
    many = k >= CG_MIN_SIZE  # there is_well_conditioned is one Cholesky itself
    if (many or not _surely_ill(whole)) and is_well_conditioned(gram, whole):
        return gram, None
    spectrum = cosine_spectrum(gram)
    large = gram.shape[0] >= INTERIOR_MIN_COLUMNS
    lifted = _cagrad_lifted(spectrum) if large else None
    if lifted is not None:
        return lifted, None
    factor, _ = eigen_factor(gram, ROUNDING_MULTIPLE if large else 0.0, spectrum)
    return (factor @ factor.T if large else gram), factor


def _cagrad_qp(gram: Tensor, factor: Tensor | None, lin: Tensor, r: float, tol: float,
               blocks: BlockFactors) -> Callable[[float, Tensor | None], Tensor]:
    """``(ρ, x0) ↦ argmin_{w∈Δ} ½ (r/ρ) wᵀGw + wᵀlin`` from ``x0`` (if any): the QPs of
    :func:`cagrad_dual`'s root search on :func:`_cagrad_problem`'s ``G``: the pivoting on a
    well-conditioned one (:func:`~._boxqp.solve_single_kept`, each free block's factor
    ``√(r/ρ) L_FF`` from ``blocks``), else on
    ``√(r/ρ) L`` with ``lin = G1/K ≈ L h``, ``h = Lᵀ1/K`` (:func:`~._boxqp.factored_box_qp`),
    the path :func:`solve_box_qp` takes for it, without a decomposition per point."""
    k = gram.shape[0]
    zeros = torch.zeros(k, dtype=torch.float64)
    if factor is None:
        def pivoted(rho: float, x0: Tensor | None) -> Tensor:
            scale = r / rho
            q, root = gram * scale, scale ** 0.5

            def factor_of(idx: list[int]) -> Factor:
                low, info = blocks.factor(idx)
                return Factor(low * root, info)
            return solve_single_kept(q, lin, zeros, True, x0, tol, factor_of)
        return pivoted
    coords = factor.T.mean(dim=1)

    def solve(rho: float, x0: Tensor | None) -> Tensor:
        root = (r / rho) ** 0.5
        return factored_box_qp(factor * root, lin, zeros, True, x0, tol, coords / root)
    return solve


def _cagrad_lifted(spectrum: CosineSpectrum) -> Tensor | None:
    """``G' = D(C + εI)D`` for CAGrad's root search (``ε``: the single dual QPs' lift of the
    cosine matrix ``C``, :func:`~._min_norm_dual.lifted_cosine`: a float32 Gramian of rows of
    which a few are combinations of others; within ``1 + ROUNDING_MULTIPLE`` times the given
    Gramian's distance from the rows' exact one), where ``G'`` is also well conditioned
    (:func:`~._boxqp.is_well_conditioned`: ``D`` can spread ``C + εI``'s condition number
    by ``(max D/min D)²``); None elsewhere (a zero row, no lift)."""
    norms = spectrum.norms
    got = lifted_cosine(spectrum)
    if got is None:
        return None
    lifted = got[0].mul_(torch.outer(norms, norms))
    return lifted if is_well_conditioned(lifted) else None


def _surely_ill(whole: Factor) -> bool:
    """Whether ``G`` is certainly not :func:`~._boxqp.is_well_conditioned` (condition number
    at least ``1e10``), from a Cholesky factorisation (``K³/3`` against an eigenvalue
    decomposition): it fails (not positive definite in float64), or its pivots ``Lᵢᵢ²`` span
    more than ``10 · 1e10``; ``λ_min ≤ min Lᵢᵢ² ≤ max Lᵢᵢ² ≤ λ_max`` (each pivot is
    ``1/((G_{:i,:i})⁻¹)ᵢᵢ ≥ λ_min`` and at most ``Gᵢᵢ``), the factor 10 for rounding.
    ``whole``: ``G``'s factor."""
    chol, info = whole
    if int(info) != 0:
        return True
    pivots = torch.diagonal(chol).square()
    return bool(pivots.max() > 10.0 * CHOLESKY_MAX_COND * pivots.min())


def _fair_measures(gram: Tensor, w: Tensor, p: float, norms: Tensor,
                   gabs: Tensor) -> list[float]:
    """``[f(w), residual, max w, cancellation, rounding]`` in one host sync: the potential
    ``½ wᵀGw − Σ φ(wᵢ)``, ``φ' = w^{-p}`` (``φ = log`` for ``p = 1``), ``max |wᵢ^p (Gw)ᵢ − 1|``,
    :func:`cancellation` (``norms = diag(G)^{1/2}``) and the residual's rounding,
    ``√K eps max wᵢ^p (|G|w)ᵢ`` (``gabs = |G|``; float64's rounding of ``Gw``, whose terms
    reach ``|G|w``), at most ``FAIR_ROUNDING_MAX``."""
    gw = gram @ w
    quad = w @ gw
    phi = torch.log(w).sum() if p == 1.0 else (w.pow(1.0 - p) / (1.0 - p)).sum()
    wp = w.pow(p)
    rounding = ((wp * (gabs @ w)).max() * (w.shape[0] ** 0.5 * _EPS)).clamp_max(
        FAIR_ROUNDING_MAX)
    return torch.stack([0.5 * quad - phi, (wp * gw - 1.0).abs().max(), w.max(),
                        quad / (w @ norms).square(), rounding]).tolist()


def cancellation(gram: Tensor, w: Tensor) -> float:
    """``‖Σ wᵢgᵢ‖² / (Σ wᵢ‖gᵢ‖)²`` of weights ``w ≥ 0`` (not all on zero rows) from the
    Gramian: 1 for aligned rows, 0 where the combination vanishes, scale-free per row; a
    Gramian of float32 rows resolves it to about ``1e-7`` (it can read slightly negative)."""
    norms = torch.diagonal(gram).clamp_min(0.0).sqrt()
    return float((w @ gram @ w) / (w @ norms).square())


def _fair_start(gram: Tensor, p: float, w0: Tensor | None) -> Tensor:
    """The warm start if it is positive with one entry per task, else the solution for
    orthogonal rows ``Gᵢᵢ^{-1/(1+p)}``; then its best multiple: ``d/ds f(s·w) = 0`` at
    ``s^{1+p} = Σ wᵢ^{1−p} / wᵀGw``, which removes the scale error of a cold or stale start
    (and solves ``K = 2`` for ``p = 1`` exactly)."""
    if w0 is None or w0.numel() != gram.shape[0] or not bool(torch.all(w0 > 0)):
        w = torch.diagonal(gram).pow(-1.0 / (1.0 + p))
    else:
        w = w0.to(gram).clone()
    quad = float(w @ gram @ w)
    if quad > 0.0:
        w = w * (float(w.pow(1.0 - p).sum()) / quad) ** (1.0 / (1.0 + p))
    return w


@dataclass
class _Float32Gram:
    """:func:`fair_newton`'s Gramian in float32 for its early steps (``gram``), dropped at the
    first float32 factorisation that fails: the iterate's ``p w^{-p-1}`` has fallen below
    float32's resolution of ``G`` (weights growing along a vanishing combination), and the
    later steps' would fail too (rank K/2 at K = 1,024: 7 of the last 9)."""

    gram: Tensor | None


def _newton_solve(gram: Tensor, diagonal: Tensor, grad: Tensor,
                  low: _Float32Gram | None = None) -> tuple[Tensor, Tensor]:
    """``(H⁻¹ grad, info)`` for :func:`_fair_step`'s Hessian ``H = G + diag(diagonal)``
    (``diagonal = p w^{-p-1} > 0``: symmetric positive definite where ``G`` is PSD): with
    ``low`` holding ``G`` in float32, by its Cholesky factorisation in float32 where that
    succeeds with a finite answer (else ``low`` drops it); else from ``BLOCKED_MIN_SIZE``
    tasks on, on the CPU, by the blocked Cholesky factorisation
    (:func:`~._cholesky.cholesky_ex`; at K = 1,024 on one thread 17 ms against 32–36 ms for
    the LU solve, about half a Newton step; ``H`` formed in place on a copy of ``G``), by
    :func:`torch.linalg.solve_ex` where it does not factorise (a float32 Gramian's negative
    rounding against a diagonal that small) and below that size."""
    if low is not None and low.gram is not None:
        hessian = low.gram.clone()
        hessian.diagonal().add_(diagonal.to(hessian.dtype))
        factor, info = cholesky_ex(hessian)
        if int(info) == 0:
            step = cholesky_solve(grad.to(hessian.dtype)[:, None], factor)[:, 0].to(gram.dtype)
            if bool(torch.isfinite(step).all()):
                return step, info
        low.gram = None
    if gram.shape[0] >= BLOCKED_MIN_SIZE and gram.device.type == "cpu":
        hessian = gram.clone()
        hessian.diagonal().add_(diagonal)
        lower, info = cholesky_ex(hessian)
        if int(info) == 0:
            return cholesky_solve(grad[:, None], lower)[:, 0], info
        solved = torch.linalg.solve_ex(hessian, grad)
    else:
        solved = torch.linalg.solve_ex(gram + torch.diag(diagonal), grad)
    return solved.result, solved.info


def _fair_step(gram: Tensor, w: Tensor, p: float, measures: list[float],
               norms: Tensor, gabs: Tensor,
               low: _Float32Gram | None = None) -> tuple[Tensor, list[float]] | None:
    """One damped Newton step on ``f`` from ``w`` (gradient ``Gw − w^{-p}``, Hessian
    ``G + diag(p w^{-p-1})``, in float32 with ``low`` while the residual is above
    ``FAIR_LOW_PRECISION_ABOVE``), backtracking from the largest step that keeps
    ``w > 0`` (times 0.99) until ``f`` decreases (Armijo) or the residual does: the new
    ``(w, [f, residual])``, or None when the solve fails or the step falls below ``1e-12``."""
    value, residual = measures[:2]
    wp = w.pow(-p)
    grad = gram @ w - wp
    low = low if residual > FAIR_LOW_PRECISION_ABOVE else None
    neg_step, info = _newton_solve(gram, p * wp / w, grad, low)
    step = -neg_step
    ratio = torch.where(step < 0, -w / step, torch.full_like(w, math.inf)).min()
    ratio_v, slope, bad = torch.stack([
        ratio, grad @ step, (info != 0).to(w.dtype) + (~torch.isfinite(step)).sum()]).tolist()
    t = min(1.0, 0.99 * ratio_v) if bad == 0 else 0.0
    while t >= 1e-12:
        cand = w + t * step
        cand_measures = _fair_measures(gram, cand, p, norms, gabs)
        # Near the optimum f changes by O(residual²), below float64 resolution of f, so
        # Armijo alone stalls there; a step that lowers the residual is accepted too.
        if cand_measures[0] <= value + 1e-4 * t * slope or cand_measures[1] < residual:
            return cand, cand_measures
        t *= 0.5
    return None


def _fair_without_zero_rows(gram: Tensor, p: float, w0: Tensor | None, active: Tensor,
                            tol: float, max_iter: int) -> tuple[Tensor, float, float]:
    """A zero gradient can be neither helped nor hurt: it gets weight 0 and the system is
    solved among the ``active`` others."""
    k = gram.shape[0]
    w = torch.zeros(k, dtype=gram.dtype, device=gram.device)
    if not bool(active.any()):
        return w, 0.0, 0.0
    idx = torch.nonzero(active).flatten()
    sub0 = None if w0 is None or w0.numel() != k else w0.to(gram.device)[idx]
    w[idx], residual, rounding = fair_newton(gram[idx][:, idx], p, sub0, tol, max_iter)
    return w, residual, rounding


@dataclass
class _Stall:
    """:func:`fair_newton`'s test for a solve going nowhere: the residual has not fallen below
    0.9 of its best for ``STALL_STEPS`` steps, and it is at or below its rounding (it cannot
    fall further: the answer is as exact as float64 allows), or it stayed above 0.5 and over
    those steps ``f`` did not fall beyond rounding (``1e-15 (1 + |f|)``) or the iterate's
    rows cancel to float64's resolution of the Gramian (:func:`cancellation` at most
    ``CANCEL_FLOOR``; it reads ``≤ 0`` at float32's).

    Where no solution exists, ``w`` grows along the vanishing combination (each damped step
    doubles that part for ``p = 1``) and its cancellation falls geometrically until it meets
    the Gramian's rounding (about ``1e-7`` for float32 rows); there Newton's steps stop
    lowering ``f`` (a step is taken when it lowers the residual instead), and with ``p > 1``
    ``f`` is bounded below and levels off. A solve that converges, even to a nearly cancelling
    solution, lowers ``f`` on every step until the residual falls (quadratically near it), to
    ``tol`` or to its rounding: weights up to 1e6 on rows of rank ``K/4`` plus noise 1e-3 of
    their size leave it near 3e-9, where 80 more steps moved nothing."""

    best: float
    values: list[float] = field(default_factory=list)

    def diverging(self, measures: list[float]) -> bool:
        """Whether to stop after a step to ``measures`` (of :func:`_fair_measures`)."""
        value, cancel = measures[0], measures[3]
        if measures[1] < 0.9 * self.best:
            self.best, self.values = measures[1], []
        self.values.append(value)
        if len(self.values) <= STALL_STEPS:
            return False
        if self.best <= measures[4]:
            return True
        if self.best <= 0.5:
            return False
        level = self.values[-1 - STALL_STEPS] - value <= 1e-15 * (1.0 + abs(value))
        return level or cancel <= CANCEL_FLOOR


def fair_newton(gram: Tensor, p: float, w0: Tensor | None = None, tol: float = 1e-10,
                max_iter: int = 100) -> tuple[Tensor, float, float]:
    """``(w, residual, rounding)``: the ``w > 0`` with ``(G w)ᵢ = wᵢ^{-p}`` (Nash-MTL: ``p =
    1``; FairGrad: ``p = 1/α``), ``max |wᵢ^p (Gw)ᵢ − 1|`` at the returned ``w`` and that
    residual's rounding there (:func:`_fair_measures`): a residual at most
    ``max(tol, rounding)`` is a solution.

    Damped Newton on the strictly convex ``f(w) = ½ wᵀGw − Σ φ(wᵢ)``, ``φ' = w^{-p}``, from
    the start (warm, or the orthogonal-rows solution) rescaled to its best multiple,
    backtracking to stay in ``w > 0`` and to decrease ``f`` or the residual, on the Gramian's
    device (two host syncs a step). Stops at ``residual ≤ tol``, once the residual has not
    fallen for a few steps at or below its rounding, or early when ``w`` diverges: the solve
    fails, ``max w`` grows 1e12-fold, or the residual has stalled while ``w``'s combination
    cancels (:class:`_Stall`). A solution exists exactly when no non-negative combination of
    the non-zero rows vanishes (else ``f`` falls without bound along it, for ``p ≤ 1``, or
    has no minimiser); the caller judges the residual. A row with ``Gᵢᵢ`` below
    ``ZERO_ROW · tr G`` gets ``wᵢ = 0`` and the system is solved among the others.
    """
    diag = torch.diagonal(gram)
    active = diag > ZERO_ROW * diag.sum().clamp_min(1e-300)
    if not bool(active.all()):
        return _fair_without_zero_rows(gram, p, w0, active, tol, max_iter)
    norms = diag.clamp_min(0.0).sqrt()
    gabs = gram.abs()
    low = (_Float32Gram(gram.to(torch.float32)) if gram.shape[0] >= FAIR_LOW_PRECISION_MIN_SIZE
           and gram.device.type == "cpu" else None)
    w = _fair_start(gram, p, w0)
    measures = _fair_measures(gram, w, p, norms, gabs)
    limit = 1e12 * measures[2]
    stall = _Stall(measures[1])
    for _ in range(max_iter):
        if measures[1] <= tol:
            break
        moved = _fair_step(gram, w, p, measures, norms, gabs, low)
        if moved is None or moved[1][2] > limit:
            break
        w, measures = moved
        if stall.diverging(measures):
            break
    return w, measures[1], measures[4]


def nash_bargaining(
    gram: Tensor, alpha0: Tensor | None = None, tol: float = 1e-10, max_iter: int = 100,
    no_solution: str = "ridge",
) -> Tensor:
    """Nash-MTL: the ``α > 0`` with ``(G α)ᵢ = 1/αᵢ`` (Navon et al. 2022, Thm 5.1), by
    :func:`fair_newton` with ``p = 1`` from the warm start ``alpha0``. A zero gradient gets
    ``αᵢ = 0``.

    No solution exists when a non-negative combination of non-zero gradients vanishes
    (``max |αᵢ (Gα)ᵢ − 1| > tol`` at the stop). Then ``no_solution="raise"`` raises
    :class:`SolverError`; ``"ridge"`` warns and solves ``((G + εD) α)ᵢ = 1/αᵢ`` (to a
    residual ``NASH_RIDGE_TOL``) with
    ``ε = NASH_RIDGE · tr G`` and ``D`` the indicator of the non-zero rows: the
    bargaining of the gradients each lengthened by a private coordinate ``√ε``, which always
    has a solution, with ``αᵀGα ≤ K`` (the update stays bounded) and ``gᵢ·g = 1/αᵢ − εαᵢ``.
    """
    alpha, residual, rounding = fair_newton(gram, 1.0, alpha0, tol, max_iter)
    if residual <= max(tol, rounding):
        return alpha
    k = gram.shape[0]
    message = (f"Nash-MTL bargaining solve did not converge (K={k}, residual {residual:.1e} "
               f"after at most {max_iter} Newton steps); a non-negative combination of the "
               f"task gradients is (nearly) zero, so G α = 1/α has no solution")
    if no_solution == "raise":
        raise SolverError(message)
    diag = torch.diagonal(gram)
    trace = diag.sum()
    live = (diag > ZERO_ROW * trace.clamp_min(1e-300)).to(gram.dtype)
    ridged = gram + torch.diag(live * (NASH_RIDGE * trace))
    # From the warm start too: a previous call's ridge solution (the balancer's state) is
    # within a step or two of this one's, where a cold start takes 9-11 at K = 1,024.
    alpha, residual, rounding = fair_newton(ridged, 1.0, alpha0, max(tol, NASH_RIDGE_TOL),
                                            max_iter)
    if not residual <= max(tol, NASH_RIDGE_TOL, rounding):  # G + εD is positive definite
        raise SolverError(message + f"; the ridge solve stopped at residual {residual:.1e}")
    # The text carries no per-call numbers: Python shows it once per place, not every step.
    warnings.warn(f"Nash-MTL's bargaining equation G α = 1/α has no solution for these {k} "
                  f"task gradients (a non-negative combination of them vanishes): solved "
                  f"(G + εI) α = 1/α with ε = {NASH_RIDGE:g} tr G instead "
                  f"(NashMTL(no_solution=\"ridge\"), docs/balancers.md); pass "
                  f"no_solution=\"raise\" to get a SolverError", RuntimeWarning, stacklevel=2)
    return alpha
