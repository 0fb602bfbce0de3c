"""Simplex problems on rows that fall into groups of parallel rows, each group collapsed.

Not a balancer module (no ``__all__``). :func:`collapse` finds the groups for the problems
that read the weights ``w`` only through ``g_w = Jᵀw``: MGDA's min-norm point
(:func:`grouped_min_norm`, below), CAGrad's dual (``_solvers._grouped_cagrad``: each group
one row, its shortest or its longest members by the sign of the optimal value, with the
group's share of ``g₀``, :meth:`Collapse.lengths`) and PCD's secondary constraints
(``_pcd._grouped_weights``: copies with the same ``τ`` are one constraint). Each caller
checks the answer on the whole Gramian and keeps its exact path for the rest.

For MGDA, rows on one ray, ``u`` and ``c·u`` with ``c ≥ 1``,
leave the min-norm point of the convex hull where it is without ``c·u``: a point ``p = s·cu +
(1 − s)y`` of the hull (``y`` in the hull of the others) has a point at least as short on
the segment ``[u, y]``, which separates the origin from ``[cu, y]`` in the triangle ``(0,
cu, y)``: the ray from the origin through ``p`` crosses it at ``αp``, ``α ≤ 1``. So a group
of rows parallel with one sign (within the Gramian's rounding,
:func:`~._parallel_groups.find_groups`) keeps its shortest member, and the members as short
within that rounding share its weight equally (a task given twice: the same weight each);
the others get 0. A group with both signs has the origin in its hull (the min-norm value is
0, the weights not unique): the exact path. Rows that are copies of others (a loss added
twice, per-sample objectives with repeated samples) make the Gramian singular, which costs
the exact path an eigen-decomposition, the interior point and Lawson–Hanson's one column
at a time; collapsed, what is left is the Gramian of the distinct rows (MGDA at K = 1,024 on
512 Gaussian rows each given twice, one thread: 6.3 → 0.3 s).

The answer is kept only where it meets MGDA's KKT conditions on the whole Gramian, ``(Gw)ⱼ ≥
wᵀGw`` with equality where ``wⱼ > 0``, to ``(δ + KKT_RTOL)(dⱼ s + s²)`` (``d = diag(G)^{1/2}``,
``s = dᵀw``; ``δ`` the grouping's deviation of the cosines, which moves ``(Gw)ⱼ`` by at most
``δ dⱼ s`` and ``wᵀGw`` by ``δ s²``); else None, and the caller's exact path decides.
Cost: ``O(K²)`` to find the groups (one pass where there are none), the reduced solve, and
``O(K²)`` for the check.

Example:
    >>> import torch
    >>> from gradbalance.balancers._min_norm_groups import grouped_min_norm
    >>> from gradbalance.balancers._solvers import min_norm_simplex
    >>> rows = torch.randn(12, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    >>> rows = torch.cat([rows, rows[:6]])  # six tasks given twice: 18 rows
    >>> g = rows @ rows.T
    >>> w = grouped_min_norm(g / g.trace(), min_norm_simplex)
    >>> bool(torch.allclose(w[:6], w[12:], rtol=0, atol=1e-15)), round(float(w.sum()), 12)
    (True, 1.0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ._parallel_groups import FLOOR_PER_ROW, GROUPS_MIN_SIZE, KKT_RTOL, row_groups

#: ``G → argmin_{w ∈ Δ} wᵀGw`` (``G`` trace-normalised): the reduced problem's solver.
MinNorm = Callable[[Tensor], Tensor]


@dataclass(frozen=True)
class Collapse:
    """Rows collapsed for a simplex problem that reads the weights only through ``g_w =
    Jᵀw``: ``members`` (the rows that share their group's weight: as short as its shortest
    within the rounding, or with ``longest`` as long as its longest), ``kept`` (one member
    per group, the first; the reduced problem's rows, increasing), ``rep`` (each row's group
    representative), ``delta`` (the grouping's deviation of the cosines) and ``d =
    diag(G)^{1/2}``."""

    members: Tensor
    kept: Tensor
    rep: Tensor
    delta: float
    d: Tensor
    longest: bool = False

    def spread(self, w_kept: Tensor) -> Tensor:
        """The weights ``[K]``: each kept row's weight split equally over its group's
        members, none for the others."""
        k = self.rep.shape[0]
        dtype = w_kept.dtype
        share = torch.zeros(k, dtype=dtype).index_add_(0, self.rep, self.members.to(dtype))
        at_rep = torch.zeros(k, dtype=dtype).index_copy_(0, self.rep[self.kept], w_kept)
        return torch.where(self.members, at_rep[self.rep] / share[self.rep].clamp_min(1.0), 0.0)

    def lengths(self) -> Tensor:
        """``[len(kept)]``: each group's summed norm over its kept row's, ``Σⱼ dⱼ/d_kept``
        (the rows of a one-signed group are positive multiples of one another: ``Jᵀm`` for
        weights ``m`` on the whole group is this times ``Σm`` on the kept row)."""
        total = torch.zeros(self.rep.shape[0], dtype=self.d.dtype).index_add_(
            0, self.rep, self.d)
        return total[self.rep[self.kept]] / self.d[self.kept]

    def other_side(self) -> Collapse | None:
        """The same groups kept as their longest members instead of their shortest (or the
        reverse); None where every group's members are equally long (the same collapse)."""
        if bool(self.members.all()):
            return None
        return _side(self.rep, self.d, self.delta, not self.longest)


def collapse(gram: Tensor, copies_only: bool = False, labels: Tensor | None = None,
             longest: bool = False, rounding: float = 0.0) -> Collapse | None:
    """The groups of rows parallel with one sign within the rounding of ``gram`` (float64,
    :func:`~._parallel_groups.row_groups`), each kept as its shortest members (with
    ``longest``, its longest); with ``copies_only``, only where every member of every group
    is as short (the rows are copies of one another: no longer multiple dropped) and, with
    ``labels`` ``[K]``, has its representative's label (PCD's ``τⱼ``: copies with different
    guarantees are different constraints). None below ``GROUPS_MIN_SIZE`` tasks, with a zero
    row, where no group removes enough rows, where a group has both signs, or
    (``copies_only``) where one has a longer member or another label. ``rounding``: the
    products' rounding where the caller knows it (:func:`~._parallel_groups.find_groups`)."""
    k = gram.shape[0]
    if k < GROUPS_MIN_SIZE:
        return None
    found = row_groups(gram, rounding)  # None: a zero row, or no groups (the exact path)
    if found is None:
        return None
    d, _, groups = found
    if groups.free.numel() or bool(groups.two.any()):
        return None
    out = _side(groups.rep, d, groups.delta, longest)
    if copies_only and not bool(out.members.all()):
        return None
    if labels is not None and not torch.equal(labels, labels[groups.rep]):
        return None
    return out


def _side(rep: Tensor, d: Tensor, delta: float, longest: bool) -> Collapse:
    """Each group's shortest members (``longest``: its longest), within ``delta`` or
    float64's rounding of the norms of rows that are exact copies, whichever is larger."""
    k = rep.shape[0]
    margin = 1.0 + max(delta, FLOOR_PER_ROW * k)
    if longest:
        high = torch.zeros(k, dtype=d.dtype).scatter_reduce_(0, rep, d, "amax")
        members = d * margin >= high[rep]
    else:
        low = torch.full((k,), torch.inf, dtype=d.dtype).scatter_reduce_(0, rep, d, "amin")
        members = d <= low[rep] * margin
    index = torch.arange(k)
    first = torch.full((k,), k, dtype=torch.int64).scatter_reduce_(
        0, rep, torch.where(members, index, k), "amin")
    return Collapse(members, torch.unique(first[rep]), rep, delta, d, longest)


def grouped_min_norm(gram: Tensor, solve: MinNorm) -> Tensor | None:
    """``argmin_{w ∈ Δ} wᵀGw`` ``[K]`` (``gram`` trace-normalised, float64) with each
    one-signed group of parallel rows collapsed to its shortest members (:func:`collapse`),
    the reduced problem solved by ``solve``; None where :func:`collapse` is, or where the
    answer fails MGDA's KKT check on ``gram``."""
    groups = collapse(gram)
    if groups is None:
        return None
    reduced = gram[groups.kept][:, groups.kept]
    w = groups.spread(solve(reduced / torch.trace(reduced)))
    return w if _kkt_holds(gram, w, groups.d, groups.delta + KKT_RTOL) else None


def _kkt_holds(gram: Tensor, w: Tensor, d: Tensor, rtol: float) -> bool:
    """MGDA's KKT conditions on ``gram`` at ``w`` (on the simplex): ``(Gw)ⱼ − wᵀGw ≥ −bⱼ``
    everywhere and ``≤ bⱼ`` where ``wⱼ > 0``, ``bⱼ = rtol (dⱼ s + s²)``, ``s = dᵀw``."""
    gw = gram @ w
    gap = gw - w @ gw
    s = d @ w
    bound = rtol * (d * s + s * s)
    ok = (gap >= -bound) & ((w <= 0.0) | (gap <= bound))
    return bool(ok.all() & torch.isfinite(w).all() & (w >= 0.0).all())
