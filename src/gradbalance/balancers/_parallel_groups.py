"""Many box QPs on a ``Q`` whose rows fall into groups of parallel rows, each group collapsed.

Not a balancer module (no ``__all__``). ``min ½ vᵀQv`` s.t. ``v ≥ lowerᵦ`` on the cosine
variables ``s = Dv`` (``D = diag(Q)^{1/2}``, ``C = D⁻¹QD⁻¹``, as :mod:`~._cone`) depends on a
group ``S`` of rows with unit directions ``σⱼ a`` (``σⱼ = ±1``) only through ``t = Σ_S σⱼ sⱼ``,
the group's coefficient along ``a``:

- **both signs in ``S``**: ``t`` takes every real value (each ``sⱼ`` is bounded below only),
  so ``a`` is a free direction: ``t = −C_TT⁻¹ C_TR z`` minimises over the groups' directions
  ``T`` for the others' values ``z``, and ``z`` solves the box QP on the Schur complement
  ``C_RR − C_RT C_TT⁻¹ C_TR`` (the rows projected on the orthogonal complement of the
  groups' directions; Quinton & Rey 2024, Prop. 1 on those rows);
- **one sign**: ``t ≥ Σ_S lowerⱼ`` is one bound on one representative row.

The weights inside a group are not unique (the update, a projection on a convex cone, is):
each member keeps its bound and the excess ``t − Σ σⱼ lowerⱼ`` is split equally over the
members of its sign (one-signed: over all members). Rows are grouped where ``|Cⱼₖ| ≥ 1 − τ``
with ``τ = ROUNDING_MULTIPLE ρ`` and ``ρ = maxⱼ≠ₖ |Cⱼₖ| − 1`` the rounding the matrix shows
(no exact cosine matrix has ``|Cⱼₖ| > 1``: a Gramian multiplied in float32 shows about
``10⁻⁶``), at least ``FLOOR_PER_ROW · n``, and with ``ρ`` at least the products' rounding
where the caller knows it (PCD's, on a Gramian whose rounding was removed and shows none:
:func:`find_groups`); ``C`` is then replaced by ``C̃``, its group rows
exact multiples of their representative's, ``δ = maxⱼₖ |Cⱼₖ − C̃ⱼₖ|`` measured. The answer is
kept only where it meets the KKT conditions of the full problem on ``Q`` to ``(η + δ) ‖s‖₁``
(``η = KKT_RTOL``; ``δ ‖s‖₁`` bounds ``|((C − C̃)s)ⱼ|``); the other problems, and every
problem where fewer than ``MIN_FRACTION`` of the rows collapse, go to the exact path.
Cost: ``O(n²)`` to find the groups, the reduced problem's solve, ``O(B n²)`` for the check.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ._box_kkt import box_kkt_holds
from ._boxqp import CG_ERROR
from ._cholesky import cholesky_ex, cholesky_solve
from ._precond import symmetrized

#: Fewest tasks for which groups are looked for (below, the dense solve is cheap).
GROUPS_MIN_SIZE = 17
#: Multiple of the rounding ``ρ`` the matrix shows within which a cosine counts as ``±1``.
ROUNDING_MULTIPLE = 4.0
#: ``τ`` is at least this times ``n`` (float64 rounding of a cosine, for a matrix showing none).
FLOOR_PER_ROW = 16 * torch.finfo(torch.float64).eps
#: Fewest rows, as a fraction of ``n``, that grouping must remove to be used.
MIN_FRACTION = 1.0 / 16.0
#: One problem whose groups all have one sign is collapsed only where the rows left are
#: independent: every Cholesky pivot of their cosine block at least this. Else the reduced
#: problem is as singular as the whole and the collapse only adds its cost (DualProj on
#: rank-8 rows with near copies at K = 64: 1.6 → 6.9× the Gramian), where copies of
#: independent rows leave a positive definite one (conflicting rows each given twice: 7.1 →
#: 1.8× at K = 64, 3.1 → 1.35× at K = 1,024; before, one problem needed a group of both
#: signs).
SINGLE_MIN_PIVOT = 1e-3
#: Rows whose float32 cosine is below ``1 − SCREEN`` are not near parallel (float32's
#: rounding of a cosine is about 1e-7).
SCREEN = 1e-2
#: Relative KKT tolerance of the full problem, besides the grouping's ``δ``: above the
#: reduced solve's own accuracy and the ``n·eps`` rounding of the check's product. From
#: ``CG_MIN_SIZE`` rows the reduced batch is solved by the conjugate-gradient pivoting, each
#: projection ``x = Jᵀv`` to ``CG_ERROR ‖x‖`` (:func:`~._boxqp.tight_residuals`), which moves
#: ``wⱼ = gⱼᵀx`` by at most ``CG_ERROR dⱼ ‖x‖ ≤ CG_ERROR dⱼ Σ dₖ|vₖ|``: twice that. (At
#: ``1e-9``, 18 of UPGrad's 256 projections of conflicting rows each given twice failed the
#: check by 1.1–1.35× and went to the singular routes: 5.7× the Gramian instead of 1.9×.)
KKT_RTOL = 2 * CG_ERROR

#: An excess ``t − Σ σⱼ lowerⱼ`` up to this times ``|t| + Σ |lowerⱼ|`` is the rounding of
#: the reduced solve's scaling: no member takes it (and a row that close to its bound is
#: set on it).
EXCESS_ROUNDING = 16 * torch.finfo(torch.float64).eps

#: ``(Q, lower) → argmin_{x ≥ lowerᵦ} ½ xᵀQx`` for ``lower`` ``[B, n]``.
Solve = Callable[[Tensor, Tensor], Tensor]


@dataclass
class Groups:
    """Rows of ``C`` ``[n, n]`` in groups: ``rep`` per row (its group's representative, itself
    for a lone row), ``sign`` (``σⱼ``), ``two`` (rows whose group has both signs), ``keep``
    (the rows of the reduced problem: lone rows, one-signed representatives), ``free`` (the
    two-signed groups' representatives) and ``delta`` (``max |C − C̃|``)."""

    rep: Tensor
    sign: Tensor
    two: Tensor
    keep: Tensor
    free: Tensor
    delta: float


def find_groups(cos: Tensor, rounding: float = 0.0) -> Groups | None:
    """The groups of rows of the cosine matrix ``cos`` that are parallel within its rounding,
    or None where they remove fewer than ``MIN_FRACTION`` of the rows. ``rounding``: the
    rounding the products left in ``cos`` where the caller knows it
    (:func:`~gradbalance.gramian.products_rounding`), taken as the rounding shown: a Gramian
    whose rounding was removed (:func:`~._denoise.cleaned`) shows none, ``max |Cⱼₖ| ≤ 1``,
    while its rows' cosines with the others still differ by it and by the removal's (copies
    at norms decades apart: by ``3e-8`` at P = 20,000, ``9e-7`` at P = 300, the products'
    rounding ``3.6e-7`` there)."""
    n = cos.shape[0]
    mag = cos.abs()
    mag.fill_diagonal_(0.0)
    rho = float(mag.max()) - 1.0
    tau = max(ROUNDING_MULTIPLE * max(rho, rounding), FLOOR_PER_ROW * n)
    if rho < -tau:  # no two rows near parallel (the common case): one pass
        return None
    near = mag >= 1.0 - tau
    counts = near.sum(dim=1)
    if int((counts > 0).sum()) < max(2, int(MIN_FRACTION * n)):
        return None
    rep = _representatives(near)
    if n - int(torch.unique(rep).numel()) < max(1, int(MIN_FRACTION * n)):
        return None
    groups = _groups(cos, rep)
    if groups.delta > 2.0 * tau:  # a row off its group: not rounding
        return None
    return groups


def row_groups(q: Tensor, rounding: float = 0.0) -> tuple[Tensor, Tensor, Groups] | None:
    """``(d, C, groups)`` for ``Q`` (float64): ``d = diag(Q)^{1/2}``, the cosine matrix
    ``C = D⁻¹QD⁻¹`` and its :func:`find_groups` (``rounding``: the products', where known);
    None with a zero row, where no two rows are near parallel (:func:`_may_be_parallel`:
    ``C`` is then never formed), or where :func:`find_groups` finds none."""
    d = torch.diagonal(q).sqrt()
    if not bool((d > 0.0).all()) or not _may_be_parallel(q, d):
        return None
    cos = q / torch.outer(d, d)
    groups = find_groups(cos, rounding)
    return None if groups is None else (d, cos, groups)


def _may_be_parallel(q: Tensor, d: Tensor) -> bool:
    """Whether the largest ``|Qⱼₖ|/(dⱼdₖ)`` off the diagonal, in float32, is at least ``1 −
    SCREEN``: else no two rows are within any rounding of parallel and :func:`find_groups`
    would find nothing (its tolerance is the rounding the matrix shows, ``max |Cⱼₖ| − 1``,
    or float64's). Three passes over a float32 copy instead of five over the float64 cosine
    matrix (K = 1,024, one thread: 0.4 against 12 ms). A product that overflows or
    underflows float32 answers True or False: False only loses the collapse (the exact path
    answers)."""
    scale = d.reciprocal().float()
    cos = q.float().abs_().mul_(scale[None, :])
    cos.fill_diagonal_(0.0)
    return bool((cos.amax(dim=1) * scale).amax() >= 1.0 - SCREEN)


def _representatives(near: Tensor) -> Tensor:
    """Each row's representative: the first of its near rows (itself included), followed to
    a row that is its own (the deviation check then judges the groups, :func:`_groups`)."""
    n = near.shape[0]
    rep = (near | torch.eye(n, dtype=torch.bool)).to(torch.uint8).argmax(dim=1)
    while True:  # pointer jumping: at most log₂ n rounds
        nxt = rep[rep]
        if torch.equal(nxt, rep):
            return rep
        rep = nxt


def _groups(cos: Tensor, rep: Tensor) -> Groups:
    """The groups of ``rep``: signs, which have both, and ``δ`` from the rows' deviation."""
    n = cos.shape[0]
    idx = torch.arange(n)
    sign = torch.where(cos[idx, rep] < 0.0, -1.0, 1.0).to(cos.dtype)
    deviation = float((cos - sign[:, None] * cos[rep]).abs().amax())
    head = rep == idx
    negatives = torch.zeros(n, dtype=cos.dtype).index_add_(0, rep, (sign < 0.0).to(cos.dtype))
    two_rep = negatives > 0.0
    two = two_rep[rep]
    keep = torch.nonzero(head & ~two_rep).flatten()
    free = torch.nonzero(head & two_rep).flatten()
    # a cross-group entry is off by at most the deviation of each of its two rows
    return Groups(rep, sign, two, keep, free, 2.0 * deviation)


def grouped_projection(q: Tensor, lower: Tensor, reduced: Solve) -> tuple[Tensor, Tensor] | None:
    """``(v, done)``: ``v = argmin_{v ≥ lowerᵦ} ½ vᵀQv`` ``[B, n]`` for the problems ``done``
    certifies (``Q`` with a positive diagonal), the reduced problem solved by ``reduced``;
    None where ``Q`` has no groups worth collapsing (:func:`find_groups`), and for one
    problem whose groups all have one sign where the rows left are not independent
    (:func:`_independent`: the reduced problem would be as singular as the whole)."""
    n = q.shape[0]
    if n < GROUPS_MIN_SIZE or lower.shape[0] == 0:
        return None
    found = row_groups(q)
    if found is None:
        return None
    d, cos, groups = found
    if lower.shape[0] == 1 and groups.free.numel() == 0 and not _independent(cos, groups.keep):
        return None
    s_low = lower * d
    s = _collapsed_solve(cos, s_low, groups, reduced)
    if s is None:
        return None
    above = s - s_low > EXCESS_ROUNDING * (s.abs() + s_low.abs())  # else at the bound
    v = torch.where(above, s / d, lower)
    return v, box_kkt_holds(q, lower, v, groups.delta + KKT_RTOL)


def _independent(cos: Tensor, keep: Tensor) -> bool:
    """Whether the rows ``keep`` of the cosine matrix are independent: every pivot of the
    Cholesky factorisation of their block (the squared sine of a row's angle to the span of
    those before it) at least ``SINGLE_MIN_PIVOT``."""
    chol, info = cholesky_ex(cos[keep][:, keep])
    return int(info) == 0 and float(torch.diagonal(chol).square().amin()) >= SINGLE_MIN_PIVOT


def _collapsed_solve(cos: Tensor, low: Tensor, groups: Groups, reduced: Solve) -> Tensor | None:
    """The cosine variables ``s`` ``[B, n]``: the reduced problem's ``z`` on the kept rows,
    the free directions' ``t``, each group's excess split over its members; None where the
    free directions are not independent (their block has no Cholesky factor)."""
    keep, free = groups.keep, groups.free
    one = ~groups.two
    # a kept representative's bound: its one-signed group's bounds summed (``σ = 1`` there)
    z_low = torch.zeros_like(low).index_add_(1, groups.rep[one], low[:, one])[:, keep]
    c_kf = cos[keep][:, free]
    f_factor, info = cholesky_ex(cos[free][:, free])
    if int(info) != 0:
        return None
    proj = cholesky_solve(c_kf.T, f_factor)  # C_TT⁻¹ C_TR  [|T|, |R|]
    schur = cos[keep][:, keep] - c_kf @ proj
    z = _reduced(symmetrized(schur), z_low, reduced)
    t = torch.zeros_like(low)
    t[:, keep] = z
    t[:, free] = -z @ proj.T
    return _spread(low, t, groups)


def _reduced(schur: Tensor, z_low: Tensor, reduced: Solve) -> Tensor:
    """``argmin_{z ≥ z_lowᵦ} zᵀ schur z``, trace-normalised, each problem scaled to a largest
    bound of 1 (the solution is homogeneous in the bounds) and solved once per distinct
    scaled bound (the members of a group share theirs); a zero bound's answer is zero."""
    m = schur.shape[0]
    top = z_low.abs().amax(dim=1, keepdim=True) if m else z_low.new_zeros(z_low.shape[0], 1)
    z = torch.zeros_like(z_low)
    rows = torch.nonzero(top[:, 0] > 0.0).flatten()
    if rows.numel() == 0:
        return z
    distinct, back = torch.unique(z_low[rows] / top[rows], dim=0, return_inverse=True)
    trace = float(torch.diagonal(schur).sum())
    solved = reduced(schur / trace if trace > 0.0 else schur, distinct)
    z[rows] = solved[back] * top[rows]
    return z


def _spread(low: Tensor, t: Tensor, groups: Groups) -> Tensor:
    """Each row's ``s``: a lone row its ``t``; a group's members their bounds plus the excess
    ``t − Σ σⱼ lowerⱼ`` split equally over the members of its sign (one-signed: all). ``t``
    is overwritten; only the grouped columns are read (``[B, m]`` for ``m`` of them: K/16
    copies at K = 1,024, 2 against 25 ms over every column)."""
    n = low.shape[1]
    rep, sign = groups.rep, groups.sign
    cols = torch.nonzero(torch.bincount(rep, minlength=n)[rep] > 1).flatten()
    if cols.numel() == 0:
        return t
    reps, slot = torch.unique(rep[cols], return_inverse=True)  # each column's group
    low_g, sign_g = low[:, cols], sign[cols]
    width = (low.shape[0], reps.numel())
    at_low = low.new_zeros(width).index_add_(1, slot, low_g * sign_g)[:, slot]
    t_rep = t[:, rep[cols]]
    size = low.new_zeros(width).index_add_(1, slot, low_g.abs())[:, slot] + t_rep.abs()
    excess = (t_rep - at_low) * sign_g  # along each member's own sign
    takes = excess > EXCESS_ROUNDING * size  # below: the rounding of ``t − Σ σⱼ lⱼ``
    members = low.new_zeros(width).index_add_(1, slot, takes.to(low.dtype))[:, slot]
    t[:, cols] = low_g + torch.where(takes, excess / members.clamp_min(1.0), 0.0)
    return t
