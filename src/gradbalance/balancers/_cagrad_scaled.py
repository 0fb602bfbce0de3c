"""CAGrad's dual on the cosine matrix, for task gradients whose norms lie decades apart.

Not a balancer module (no ``__all__``). CAGrad's dual ``min_{w∈Δ} F(w) = wᵀlin + r‖g_w‖``
(``lin = G1/K``, ``r = c‖g₀‖``; :func:`~._solvers.cagrad_dual`) has the gradient
``linⱼ + r (Gw)ⱼ/‖g_w‖ = dⱼ ĝⱼ·(g₀ + r ĝ_w)`` (``dⱼ = ‖gⱼ‖``): each task's term is its own
norm times a cosine. Where the norms span many decades the optimum can lie among the
shortest rows, whose terms are ``dⱼ/max d`` of the longest's: on ``torch.randn`` rows of
norms ``1e-6 … 1e6`` the search on ``G`` stopped at the floor ``‖g_w‖ < 1e-12 max dⱼ``
(a "zero-norm" answer, ``d = g₀``) or at a support whose KKT test, to ``1e-12`` of the
longest row's terms, cannot see terms of ``1e-16``: updates at cosine 0.81–0.90 from the
primal's optimum (``max_d min_k gₖ·d`` s.t. ``‖d − g₀‖ ≤ r``, an SOCP), with a task's
``gₖ·d`` at ``−1e4`` where the optimum gives every task a positive one.

With ``w = a ∘ u`` (``aⱼ = min d/dⱼ``), ``F(w) = min d · F̃(u)``, ``F̃(u) = uᵀl̃ + r‖Ĵᵀu‖``
over ``u ≥ 0``, ``aᵀu = 1``: ``Ĵ`` the unit rows (Gram matrix the cosine matrix ``C``),
``l̃ⱼ = linⱼ/dⱼ``. Every term is of the order of the shortest row's, ``C`` is as well
conditioned as the directions, and the same root search over ``ρ = ‖Ĵᵀu‖`` runs on it
(:func:`~._cagrad_root.cagrad_root` with the weights ``a``; each ``ρ``'s QP a least-distance
problem on the Cholesky factor of ``C`` with the weights, :func:`~._boxqp.min_norm_ls`).
Taken where :func:`~._scaled_cosine.spread_cosine` gives ``C`` (norms decades apart; zero
rows set aside, :func:`_without_zero_rows`); where ``C`` is singular or not well
conditioned, on its eigen-factor (:func:`_singular`, its answer checked).

Example:
    >>> import torch
    >>> gen = torch.Generator().manual_seed(0)
    >>> rows = torch.randn(6, 50, generator=gen, dtype=torch.float64)
    >>> rows = rows * torch.logspace(-6, 6, 6, dtype=torch.float64)[:, None]
    >>> gram = rows @ rows.T
    >>> mean = torch.full((6,), 1 / 6.0, dtype=torch.float64)
    >>> w = scaled_cagrad(gram / torch.trace(gram), mean, 0.5, 1e-12, 200)
    >>> bool((w >= 0).all()), round(float(w.sum()), 12)
    (True, 1.0)
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._boxqp import (
    INTERIOR_MIN_COLUMNS,
    ROUNDING_MULTIPLE,
    eigen_factor,
    min_norm_ls,
    pivot_weighted_simplex,
)
from ._cagrad_root import InconsistentRoot, cagrad_root, is_cagrad_kkt, support_root
from ._cholesky import BlockFactors, Factor
from ._precond import symmetrized
from ._scaled_cosine import spread_cosine, well_conditioned_factor

#: ``‖Ĵᵀu‖`` below this (rows of unit norm) counts as a zero-norm combination.
ZERO_NORM = 1e-12
#: The root search over ``ρ = ‖Ĵᵀu‖`` starts here where ``f(ρ) > 0`` (the root is below): on
#: ``torch.randn`` rows of norms ``1e-6 … 1e6`` (K = 1,024) the root is 0.24, and a start
#: at ``max 1/aⱼ = 1e12`` took nine QPs of its eleven to come down.
START = 1.0
#: :func:`_singular` keeps its answer where the KKT conditions hold to this, relative: the
#: root search stops within its ``tol`` of ``ρ*`` and Lawson–Hanson's point is exact for its
#: ``ρ``, so the gradient's spread on the support is about ``tol`` times its scale.
KKT_RTOL = 1e-9


def scaled_cagrad(gram: Tensor, mean: Tensor, c: float, tol: float, max_iter: int,
                  factor: Tensor | None = None) -> Tensor | None:
    """CAGrad's dual weights ``w ∈ Δ`` from the cosine matrix (:mod:`~._cagrad_scaled`), or
    None where the route does not apply: fewer than three tasks, no
    :func:`~._scaled_cosine.spread_cosine` (a zero row, norms within 30× or so), ``g₀ = 0``,
    or, on a cosine matrix that is singular or not well conditioned, an answer that fails
    the KKT conditions (:func:`_singular`). ``mean``: ``g₀``'s weights (``1/K``);
    ``factor``: ``G``'s exact factor where the caller has it (a cleaned Gramian's,
    :func:`~._denoise.cleaned`: no eigen-decomposition of ``C`` again)."""
    k = gram.shape[0]
    live = torch.nonzero(torch.diagonal(gram) > 0.0).flatten()
    if 0 < live.numel() < k:
        return _without_zero_rows(gram, mean, c, tol, max_iter, live, factor)
    spread = spread_cosine(gram) if k >= 3 else None
    if spread is None:
        return None
    d, cos = spread
    lin = gram @ mean
    r = c * max(float(mean @ lin), 0.0) ** 0.5
    if r == 0.0:
        return None
    a = d.min() / d
    whole = well_conditioned_factor(cos)
    if whole is None:
        low = None if factor is None else factor / d[:, None]
        return _singular(cos, d * mean, c, a, tol, max_iter, low)
    lt = lin / d
    blocks = BlockFactors(cos)
    full = support_root(cos, lt, r, torch.ones(k, dtype=torch.bool), blocks, a)
    if full is not None and is_cagrad_kkt(cos, lt, r, full[0], full[1], tol, a):
        return _weights(full[1], a)
    h = torch.linalg.solve_triangular(whole.L, lt[:, None], upper=False)[:, 0]  # L h = l̃
    u = _search(cos, whole.L, h, lt, r, a, tol, max_iter, blocks, pivoting=True)
    return _weights(u, a)


def _without_zero_rows(gram: Tensor, mean: Tensor, c: float, tol: float, max_iter: int,
                       live: Tensor, factor: Tensor | None) -> Tensor | None:
    """:func:`scaled_cagrad` where some rows are zero (``live``: the others): a zero row
    ``e₀`` adds nothing to ``g_w`` nor to ``wᵀlin``, so ``F((1 − t)w + t e₀) = (1 − t)F(w)``
    and the optimum is the live rows' own ``w*`` where ``F(w*) < 0``, else ``e₀`` (``g_w =
    0``: the update ``g₀``). ``g₀`` and ``r`` keep their values (the zero rows' share of
    the mean adds nothing)."""
    sub = gram[live][:, live]
    w = scaled_cagrad(sub, mean[live], c, tol, max_iter, None if factor is None else factor[live])
    if w is None:
        return None
    r = c * max(float(mean @ gram @ mean), 0.0) ** 0.5
    value = float(w @ (sub @ mean[live])) + r * max(float(w @ sub @ w), 0.0) ** 0.5
    out = torch.zeros(gram.shape[0], dtype=torch.float64)
    if value < 0.0:
        out[live] = w
    else:
        out[int(torch.nonzero(torch.diagonal(gram) <= 0.0)[0])] = 1.0
    return out


def _singular(cos: Tensor, m: Tensor, c: float, a: Tensor, tol: float, max_iter: int,
              low: Tensor | None = None) -> Tensor | None:
    """:func:`scaled_cagrad` on a cosine matrix that is singular or not well conditioned
    (parallel rows of unequal norms, rows in a span of fewer dimensions): the search on
    ``C' = FFᵀ``, ``F`` the eigen-factor of ``C`` cut at its rounding
    (:func:`~._boxqp.eigen_factor`, as :func:`~._solvers.cagrad_dual`'s factor path), with
    ``g₀``'s weights ``m = D·mean`` on the unit rows: ``l̃ = C'm = Fh`` (``h = Fᵀm``) and
    ``r = c‖h‖``. Each QP is Lawson–Hanson's least squares (a free block of ``C'`` may be
    singular: no pivoting on its factors). The answer is kept where it meets the KKT
    conditions on ``C'`` (``KKT_RTOL``), else None (the caller's search on ``G``). ``low``:
    ``C``'s exact factor where the caller has it (then ``C' = C``)."""
    k = cos.shape[0]
    if low is None:
        low, _ = eigen_factor(cos, ROUNDING_MULTIPLE if k >= INTERIOR_MIN_COLUMNS else 0.0)
    if low.shape[1] == 0:
        return None
    cut = symmetrized(low @ low.T)
    h = low.T @ m
    lt = low @ h
    r = c * float(torch.linalg.vector_norm(h))
    if r == 0.0:
        return None
    try:
        u = _search(cut, low, h, lt, r, a, tol, max_iter, BlockFactors(cut), pivoting=False,
                    strict=True)
    except InconsistentRoot:  # its QPs decided by rounding: the caller's search on G
        return None
    rho = max(float(u @ cut @ u), 0.0) ** 0.5
    if not rho > ZERO_NORM or not is_cagrad_kkt(cut, lt, r, rho, u, KKT_RTOL, a):
        return None
    return _weights(u, a)


def _search(cos: Tensor, low: Tensor, h: Tensor, lt: Tensor, r: float, a: Tensor,
            tol: float, max_iter: int, blocks: BlockFactors, pivoting: bool,
            strict: bool = False) -> Tensor:
    """``u`` of the root search over ``ρ = ‖Ĵᵀu‖`` on ``C = LLᵀ`` (``low``: ``L`` ``[K, m]``,
    ``l̃ = Lh``), the weighted simplex ``aᵀu = 1``; ``pivoting``: the QPs by block pivoting
    on the factors of ``C``'s free blocks where it finishes; ``strict``: raises
    :class:`~._cagrad_root.InconsistentRoot` where the QPs' values contradict the bracket."""
    state: dict[str, Tensor | None] = {"u": None}
    last: dict[float, tuple[float, Tensor]] = {}  # every point: at most the search's steps

    def f(rho: float) -> tuple[float, Tensor]:
        """``(1 − ‖Ĵᵀu‖²/ρ², u(ρ))``; NaN when ``Ĵᵀu = 0``. The QP ``min ½(r/ρ)uᵀCu + uᵀl̃``
        over ``u ≥ 0``, ``aᵀu = 1``: block pivoting on the factors of ``C``'s free blocks
        from the last point's support (:func:`~._boxqp.pivot_weighted_simplex`), else (the
        first point, or once a pivoting has not finished) ``min ‖Σ uⱼ pⱼ‖`` with ``pⱼ =
        √(r/ρ) ℓⱼ + aⱼ √(ρ/r) h`` (``C = LLᵀ``, ``l̃ = Lh``; ``h = h·aᵀu``; Lawson–Hanson,
        one index at a time from the last support: few from an empty one at the search's
        upper end, and few where consecutive supports differ by few, as on the descent of
        rows sharing a direction, where the pivoting cycles). Each point is kept (the
        search's first call repeats one of the start's)."""
        nonlocal pivoting
        if rho in last:
            return last[rho]
        root = (r / rho) ** 0.5

        def factor_of(idx: list[int]) -> Factor:
            chol, info = blocks.factor(idx)
            return Factor(chol * root, info)
        start = state["u"]
        u = (None if start is None or not pivoting else
             pivot_weighted_simplex(cos * (r / rho), lt, a, start, tol, factor_of))
        if u is None:
            if start is not None:  # a pivoting that did not finish: not tried again
                pivoting = False
            points = low.T * root + (h / root)[:, None] * a[None, :]
            u = min_norm_ls(points, state["u"], tol, a)
        state["u"] = u
        norm_sq = float(u @ cos @ u)
        value = float("nan") if norm_sq <= ZERO_NORM ** 2 else 1.0 - norm_sq / (rho * rho)
        last[rho] = value, u
        return value, u

    # The search's upper end: ‖Ĵᵀu‖ ≤ max 1/aⱼ on the weighted simplex (where f ≤ 0 the
    # answer), or the scale of one unit row where f is positive there too (φ is convex, so
    # its root is below).
    hi = float((1.0 / a).max())
    if f(hi)[0] > 0.0 and hi > START and f(START)[0] > 0.0:
        hi = START
    return cagrad_root(cos, lt, r, hi, f, tol, max_iter, blocks, a, floor=ZERO_NORM,
                       strict=strict)


def _weights(u: Tensor, a: Tensor) -> Tensor:
    """``w = a ∘ u`` on the simplex (``aᵀu = 1`` up to rounding; negative rounding cut)."""
    w = (a * u).clamp_min(0.0)
    return w / w.sum()
