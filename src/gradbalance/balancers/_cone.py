"""The dual-cone projection of UPGrad and DualProj on the cosine matrix, zero rows set aside.

Not a balancer module (no ``__all__``). ``min vᵀGv`` s.t. ``v ≥ u`` (Quinton & Rey 2024,
Prop. 1) is unchanged by a diagonal change of variables: with ``D = diag(G)^{1/2}`` and
``s = Dv`` it is ``min sᵀCs`` s.t. ``s ≥ Du`` on the cosine matrix ``C = D⁻¹GD⁻¹``, and
``v = D⁻¹s`` exactly. ``C`` has a unit diagonal whatever the rows' norms (norms spanning
``1e-6 … 1e6`` make ``G``'s condition number ``1e24`` and ``C``'s that of the directions
alone: van der Sluis 1969, a diagonal scaling within a factor ``K`` of the best), so the
solver's well-conditioned path applies. A zero row (``Gᵢᵢ = 0``) does not enter ``vᵀGv``:
every ``vᵢ ≥ uᵢ`` is optimal and ``vᵢ = uᵢ`` is taken; it is left out of the solve. Each
problem is scaled to a largest bound of 1 (the solution is homogeneous in ``u``). A Gramian
with no zero row and a diagonal within ``DIAGONAL_MAX_RATIO`` is solved as given. A matrix of
numerical rank at most ``K/4`` (up to its rounding) is solved in its rank's dimension
(:mod:`~._low_rank`); otherwise groups of rows parallel within its rounding are collapsed
first (:mod:`~._parallel_groups`, each answer certified on the whole problem). A row of
``u`` whose ``Jᵀu`` is already in the cone (``uG ≥ 0``: every multiplier of ``v ≥ u`` at
``v = u`` is non-negative, the KKT conditions hold exactly) is its own projection and is
not solved (tasks that all agree: no solve at all).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._boxqp import CG_MIN_SIZE, DIAGONAL_MAX_RATIO, certified_inverse, is_full_rank
from ._low_rank import low_rank_projection
from ._parallel_groups import grouped_projection
from ._precond import sparse_product, symmetrized

#: ``(Q, lower, tol, Q⁻¹ or None) → argmin_{x ≥ lower} ½ xᵀQx`` for ``lower`` ``[B, K]``
#: (``Q⁻¹``: certified by :func:`~._boxqp.certified_inverse`).
BoxSolve = Callable[[Tensor, Tensor, float, "Tensor | None"], Tensor]


def scaled_projection(gram: Tensor, u: Tensor, tol: float, solve: BoxSolve,
                      groups: bool = True) -> Tensor:
    """``v`` ``[B, K]`` with ``v = argmin_{v ≥ uᵦ} vᵀGv`` per row of ``u`` ``[B, K]``
    (float64): ``u``'s own rows where ``uG ≥ 0`` (already in the cone), else ``solve`` run
    on the trace-normalised cosine matrix of the non-zero rows; ``groups``: parallel rows
    collapsed first (:mod:`~._parallel_groups`)."""
    inside = _inside(gram, u)
    if bool(inside.all()):
        return u.clone()
    if bool(inside.any()):
        v = u.clone()
        v[~inside] = _outside_projection(gram, u[~inside], tol, solve, groups)
        return v
    return _outside_projection(gram, u, tol, solve, groups)


def _inside(gram: Tensor, u: Tensor) -> Tensor:
    """``[B]``: whether ``uᵦG ≥ 0`` (``Jᵀuᵦ`` in the dual cone); for a diagonal ``u`` (UPGrad's)
    the sign of each row of ``G`` times ``uᵦᵦ``, no product."""
    b, k = u.shape
    if b == k and k >= 2:
        diagonal = torch.diagonal(u)
        if int(torch.count_nonzero(u)) == int(torch.count_nonzero(diagonal)):
            signed = torch.where(diagonal[:, None] > 0.0, gram >= 0.0, gram <= 0.0)
            return signed.all(dim=1) | (diagonal == 0.0)
    return (sparse_product(u, gram.to(u.dtype)) >= 0.0).all(dim=1)


def _outside_projection(gram: Tensor, u: Tensor, tol: float, solve: BoxSolve,
                        groups: bool) -> Tensor:
    """:func:`scaled_projection` of rows ``u`` not known to be in the cone."""
    diag = torch.diagonal(gram)
    low, high = torch.stack(diag.aminmax()).tolist()  # one host sync
    if low * DIAGONAL_MAX_RATIO >= high and low > 0.0:
        return _routed(gram, u, tol, solve, groups)
    d = diag.clamp_min(0.0).sqrt()
    live = torch.nonzero(d > 0.0).flatten()
    n = live.numel()
    if n == 0:
        return u.clone()
    every = n == d.numel()  # no zero row: no gathers or scatters of the [K, K] matrices
    dl = d if every else d[live]
    part = gram if every else gram[live][:, live]
    cos = symmetrized(part / torch.outer(dl, dl * n), in_place=True)  # trace n: the solver's
    lower = (u if every else u[:, live]) * dl
    top = torch.linalg.vector_norm(lower, ord=torch.inf, dim=1)
    rows = torch.nonzero(top > 0.0).flatten()  # a zero bound: v = 0 there is optimal
    s = None
    if rows.numel():
        scale = top[rows, None]
        bounds = lower.div_(top.clamp_min(1e-300)[:, None]) if rows.numel() == top.numel() \
            else lower[rows] / scale  # lower is ours: divided in place where every row counts
        s = _routed(cos, bounds, tol, solve, groups).mul_(scale).div_(dl)
        if every and rows.numel() == u.shape[0]:
            return s
    v = u.clone()
    v[:, live] = 0.0 * lower
    if s is not None:
        v[rows[:, None], live[None, :]] = s
    return v


def _routed(q: Tensor, lower: Tensor, tol: float, solve: BoxSolve, groups: bool) -> Tensor:
    """``solve``'s answer, in the rank's dimension where ``q``'s rank is low
    (:func:`~._low_rank.low_rank_projection`), else with its groups of parallel rows
    collapsed where it has them (:func:`~._parallel_groups.grouped_projection`), the
    problems either leaves open by ``solve``. Where the solve would factorise ``q`` anyway
    (box problems on the conjugate-gradient path) and the factorisation proves it far from
    singular (:func:`~._boxqp.full_rank_inverse`), neither route is tried and the inverse
    goes to ``solve``; where it is certified but not that far from singular, the routes are
    tried and the inverse goes to ``solve`` for the problems they leave open (the solve
    would certify the same ``Q`` again)."""
    inverse = None
    if lower.shape[0] >= 2 and q.shape[0] >= CG_MIN_SIZE:
        inverse = certified_inverse(q)
        if inverse is not None and is_full_rank(q, inverse):
            return solve(q, lower, tol, inverse)
    routed = low_rank_projection(q, lower, tol)
    if routed is None and groups:
        routed = grouped_projection(
            q, lower, lambda q2, l2: scaled_projection(q2, l2, tol, solve, False))
    if routed is None:
        return solve(q, lower, tol, inverse)
    v, done = routed
    rest = torch.nonzero(~done).flatten()
    if rest.numel():  # the solve certifies Q itself from two problems on: the same inverse
        v[rest] = solve(q, lower[rest], tol, inverse if rest.numel() >= 2 else None)
    return v
