"""Dual-cone box problems with the tasks that are non-negative combinations of others dropped.

Not a balancer module (no ``__all__``). A row ``ĝⱼ = Σᵢ cᵢĝᵢ`` with ``c ≥ 0`` (a task whose
loss is the sum of others', say) is a redundant constraint of the dual cone ``{x : Jx ≥ 0}``:
``ĝⱼ·x ≥ 0`` follows from the others. So the projections of UPGrad and DualProj, ``min ½
vᵀQv`` s.t. ``v ≥ u`` on the cosine matrix ``Q`` (Quinton & Rey 2024, Prop. 1), can run on the
other rows' ``Q'``, positive definite where every null direction of ``Q`` is such a
dependency, with the lower bounds ``u' = uT`` (``T`` maps row ``j`` to ``c``, a kept row to
itself): ``Jᵀu = J'ᵀu'``. Their answer ``v' = u' + y'`` gives ``v = u + y``, ``y`` = ``y'`` on
the kept rows and 0 on the dropped ones: the same update ``Jᵀv = J'ᵀv'``, ``v ≥ u``.

The dependencies come from ``Q``'s null space (the directions at its rounding, found by two
steps of inverse subspace iteration on ``Q + 2εI``, :func:`_null_space`): its reduced echelon
basis, pivoting on the largest entries, holds a vector with one entry of one sign and the
rest of the other (a row and its non-negative combination) for each dependency that does
not share a row with another; each one found restricts the null space to the vectors
zero at its row, and the search goes on until every direction is explained (else nothing
is dropped). Each answer is kept only where the KKT conditions of the whole problem hold at
``v`` to the reduced solve's accuracy and the dropped rows' distances from their
combinations (:func:`_kkt_holds`); the others go to the lift or the singular routes. A
batch only (``_boxqp._early_routes``): one problem is as fast on the lifted ``Q``.

Cost: one Cholesky factorisation of ``Q + 2εI`` and ``O(K²m)`` for the null space
(``m ≤ K/4``), ``O(Km²)`` per round of the echelon basis, then the reduced problems on a
positive definite ``Q'`` (UPGrad on conflicting rows with K/16 of them sums of two others,
``combine`` over the Gramian: 9.4 → 2.6× at K = 256, 38 → 4.7× at K = 1,024).

Example:
    >>> import torch
    >>> from gradbalance.balancers._solvers import project_dual_cone
    >>> g = torch.randn(64, 200, generator=torch.Generator().manual_seed(0))
    >>> g = torch.cat([g, g[:8] + g[8:16]])  # eight tasks sums of two others: 72 rows
    >>> gram = (g @ g.T).double()  # a float32 product: the null space at its rounding
    >>> u = torch.eye(72, dtype=torch.float64)
    >>> v = project_dual_cone(gram / gram.trace(), u)
    >>> bool((v >= u).all()), bool((v[:, 64:] == u[:, 64:]).all())  # dropped: at their bound
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._box_kkt import box_kkt_holds
from ._cholesky import cholesky_ex, cholesky_solve
from ._precond import sparse_product

#: ``(Q', lower') → x'``: the reduced box problems' solver (``c = 0``).
Solve = Callable[[Tensor, Tensor], Tensor]

#: The fewest rows the reduction is tried on (its caller's batches start at 64).
MIN_SIZE = 17
#: Entries of a null vector below this fraction of its largest are zero (the null space of
#: a float32 Gramian carries its rounding, about ``1e-7`` relative).
ZERO_RTOL = 1e-4
#: A null direction of ``Q``: a Rayleigh–Ritz value at most this many times its rounding.
NULL_GAP = 100.0
#: The null space is looked for among ``2·nullity + NULL_MARGIN`` columns (at most ``K/4``):
#: the rounding spreads it over ``±`` a few times itself, so the cut's count can fall short.
NULL_MARGIN = 8
#: The KKT test of the whole problem (:func:`~._box_kkt.box_kkt_holds`): the reduced solve's
#: conjugate-gradient pivoting leaves multipliers past 1e-6 of that scale (UPGrad at K =
#: 1,024 on rows with K/16 sums of two others: 4 problems of 1,024, 43 past 2e-7).
KKT_RTOL = 1e-5


def without_combinations(q: Tensor, lower: Tensor, rounding: float, nullity: int,
                         solve: Solve) -> tuple[Tensor, Tensor] | None:
    """``(x, done)`` ``[B, K]``, ``[B]`` for ``min ½ xᵀQx`` s.t. ``x ≥ lower`` with the rows
    that are non-negative combinations of others dropped (module docstring); None where
    fewer than ``MIN_SIZE`` rows, no null space, or not every one of its directions is such a
    dependency. ``rounding``: the rounding of ``Q`` (its lift); ``nullity``: the number of
    eigenvalues at or below its cut (the null space found may hold more: the rounding
    spreads them, :func:`_null_space`)."""
    k = q.shape[0]
    if k < MIN_SIZE or not 0 < nullity <= k // 4 or not bool((torch.diagonal(q) > 0).all()):
        return None
    null = _null_space(q, rounding, min(k // 4, 2 * nullity + NULL_MARGIN))
    if null is None:
        return None
    found = _dependencies(null)
    if found is None:
        return None
    keep, t = found
    residual = _residuals(q, keep, t, rounding)
    if residual is None:
        return None
    reduced = q[keep][:, keep]
    low = sparse_product(lower, t)  # UPGrad's bounds: one entry per row, a gather
    x = solve(reduced, low)
    out = lower.clone()
    out[:, keep] += (x - low).clamp_min(0.0)
    return out, _kkt_holds(q, lower, out, residual)


def _null_space(q: Tensor, rounding: float, m: int) -> Tensor | None:
    """``[K, n]`` orthonormal: the eigenvectors of ``Q`` whose eigenvalues are at most
    ``NULL_GAP · rounding`` (the rounding spreads a null space over ``±`` a few times it; the
    other eigenvalues of Gramians with such dependencies lie five decades above), from two
    steps of inverse subspace iteration on ``Q + 2·rounding·I`` over ``m`` columns (a fixed
    random start) and the Rayleigh–Ritz values of ``Q`` on them; None if the shifted ``Q``
    does not factorise or none is that small."""
    k = q.shape[0]
    shifted = q.clone()
    shifted.diagonal().add_(2.0 * rounding)
    low, info = cholesky_ex(shifted)
    if int(info) != 0:
        return None
    x = torch.randn(k, m, dtype=q.dtype, generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        x = torch.linalg.qr(cholesky_solve(x, low)).Q
    lam, vec = torch.linalg.eigh(x.T @ q @ x)
    small = lam <= NULL_GAP * rounding
    if not bool(small.any()):
        return None
    null: Tensor = x @ vec[:, small]
    return null


def _dependencies(null: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(keep, T)``: the kept rows (increasing) and ``T`` ``[K, K']`` (a kept row to itself,
    a dropped row ``j`` to its coefficients ``c ≥ 0`` on the kept rows) where every direction
    of ``null`` is explained by a row that is a non-negative combination of others, else
    None."""
    k = null.shape[0]
    n = null
    dropped: list[tuple[int, Tensor]] = []
    while n.shape[1] > 0:
        hits = _dependencies_of(_echelon(n))
        if not hits:
            return None
        dropped.extend(hits)
        rows = [j for j, _ in hits]
        # the null vectors zero at the dropped rows: n z with n[rows] z = 0
        n = n @ torch.linalg.qr(n[rows].T, mode="complete").Q[:, len(rows):]
    gone = torch.zeros(k, dtype=torch.bool)
    for j, _ in dropped:
        gone[j] = True
    # a row dropped later appears only in the combinations found before it: substitute back
    final: dict[int, Tensor] = {}
    for j, coef in reversed(dropped):
        coef = coef.clone()
        later = list(final)
        for _ in range(len(later)):  # one host read per round, not one per row
            used = [i for i, c in zip(later, coef[later].tolist()) if c != 0]
            if not used:
                break
            for i in used:
                coef = coef + coef[i] * final[i]
                coef[i] = 0.0
        final[j] = coef
    keep = torch.nonzero(~gone).flatten()
    t = torch.zeros(k, keep.numel(), dtype=null.dtype)
    t[keep, torch.arange(keep.numel())] = 1.0
    for j, coef in final.items():
        t[j] = coef[keep]
    return keep, t


def _echelon(n: Tensor) -> Tensor:
    """The reduced echelon basis of the columns of ``n`` ``[K, m]``: each column 1 at its
    pivot row (the largest entry left, in turn) and 0 at the others' pivots."""
    b = n.clone()
    used = torch.zeros(b.shape[0], dtype=torch.bool)
    for col in range(b.shape[1]):
        p = int(torch.where(used, 0.0, b[:, col].abs()).argmax())
        used[p] = True
        pivot = b[:, col] / b[p, col]
        b -= b[p][None, :] * pivot[:, None]  # every column 0 at p, this one too …
        b[:, col] = pivot  # … then 1 there
    return b


def _dependencies_of(b: Tensor) -> list[tuple[int, Tensor]]:
    """The columns of ``b`` with one entry of one sign and the others of the other (entries
    below ``ZERO_RTOL`` of its largest taken as zero), each a ``(j, c)``: ``c ≥ 0`` the
    coefficients of ``ĝⱼ = Σ cᵢĝᵢ`` (``c`` ``[K]``, zero at ``j``); one per row ``j``."""
    hits: dict[int, Tensor] = {}
    for col in b.T:
        top = float(col.abs().max())
        col = torch.where(col.abs() > ZERO_RTOL * top, col, 0.0)
        for sign in (1.0, -1.0):
            lead = (sign * col) > 0
            if int(lead.sum()) == 1:
                j = int(torch.nonzero(lead)[0])
                coef = (-col / col[j]).clamp_min(0.0)
                coef[j] = 0.0
                hits.setdefault(j, coef)
                break
    return list(hits.items())


def _residuals(q: Tensor, keep: Tensor, t: Tensor, rounding: float) -> Tensor | None:
    """``[K]``: each dropped row's distance from its combination, ``‖rⱼ‖ = ‖Σ cᵢĝᵢ − ĝⱼ‖``
    (``rᵀQr``; 0 for the kept rows), where every one is at most ``√(NULL_GAP rounding) (1 +
    Σc)`` (a direction of the null space found), else None."""
    k = q.shape[0]
    gone = torch.ones(k, dtype=torch.bool)
    gone[keep] = False
    rows = torch.nonzero(gone).flatten()
    full = torch.zeros(rows.numel(), k, dtype=q.dtype)
    full[:, keep] = t[rows]
    full[torch.arange(rows.numel()), rows] = -1.0
    squared = ((full @ q) * full).sum(dim=1).clamp_min(0.0)
    bound = NULL_GAP * rounding * (1.0 + t[rows].sum(dim=1)).square()
    if not bool((squared <= bound).all()):
        return None
    out = torch.zeros(k, dtype=q.dtype)
    out[rows] = squared.sqrt()
    return out


def _kkt_holds(q: Tensor, lower: Tensor, x: Tensor, residual: Tensor) -> Tensor:
    """``[B]``: :func:`~._box_kkt.box_kkt_holds` on the whole ``Q`` to ``KKT_RTOL`` (the
    reduced solve's accuracy) plus what the dropped rows' distances ``‖rⱼ‖`` (``residual``)
    move each multiplier by: the update ``z = Ĵᵀx`` differs from the reduced one by ``Σⱼ
    lowerⱼ rⱼ`` (at most ``dᵢ Σⱼ |lowerⱼ| ‖rⱼ‖`` on ``wᵢ``, ``dᵢ = ‖ĝᵢ‖``), and a dropped
    row's ``wⱼ = Σ cᵢwᵢ − rⱼᵀz`` (``‖rⱼ‖ ‖z‖`` more), twice that."""
    d = torch.diagonal(q).clamp_min(0.0).sqrt()
    xq = x @ q  # once: the size of z and the multipliers
    z = (xq * x).sum(dim=1).clamp_min(0.0).sqrt()
    moved = lower.abs() @ residual
    slack = 2.0 * (moved[:, None] * d[None, :] + z[:, None] * residual[None, :])
    return box_kkt_holds(q, lower, x, KKT_RTOL, slack, xq)
