"""Free-set solves in mixed precision, from the projected start: float32 steps on a float64
residual.

Not a balancer module (no ``__all__``). The box pivoting of :mod:`._boxqp` on ``B`` problems
sharing ``Q`` (UPGrad's K projections) needs ``Q_FF y_F = rhs_F`` per problem to a
relative residual of about ``1e-8`` and below. In float64 every conjugate-gradient step is
a float64 product of ``[B, K] × [K, K]`` (twice a float32 one) and the preconditioner
``(Q⁻¹)_FF`` one more. Here (iterative refinement: Wilkinson 1963, Moler 1967) the residual
of the last point is exact in float64 (the caller's product), the correction ``d`` solves
``Q_FF d_F = r_F`` by conjugate gradients in float32, one float32 product per step, and
one float64 product of the new point ``y + d`` gives its exact residual, which the caller's
tests read as they read a float64 solve's. The float32 solve reaches about ``κ·eps₃₂`` of
``‖r‖`` (the rounding of ``Q`` in float32), so one round takes a start ``1e-4`` off to
``1e-8``; a round that does not shrink the residual tenfold is reported stalled (the caller
then solves in float64).

The steps are preconditioned by the projected start's scaling (:class:`~._projected.Plan`):
``SQS ≈ I + U diag(c) Uᵀ`` (``S`` the bulk's diagonal scaling, ``U`` its ``m ≤ 16`` outlying
eigen-directions), so ``M⁻¹r = S (I + U_F diag(c) U_Fᵀ)⁻¹ S r`` on each free set ``F`` by
the Woodbury identity, ``O(K m)`` per problem and step: where the scaled bulk is well
conditioned (the plan's test), as fast per step as ``(Q⁻¹)_FF`` is and a product cheaper.

Example:
    >>> import torch
    >>> q = torch.tensor([[2.0, -1.0, 0.0], [-1.0, 2.0, -1.0], [0.0, -1.0, 2.0]],
    ...                  dtype=torch.float64)
    >>> pre = ScaledPreconditioner(torch.full((3,), 2.0 ** -0.5), None, None)
    >>> free = torch.tensor([[True, True, False]])
    >>> shift = torch.tensor([[-1.0, -1.0, 0.0]], dtype=torch.float64)
    >>> y = torch.zeros(1, 3, dtype=torch.float64)
    >>> out = mixed_free_solve(q, q.float(), pre, shift, free, y, y.clone(),
    ...                        torch.tensor([1e-6], dtype=torch.float64))
    >>> expected = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    >>> torch.allclose(out.y, expected), bool(out.converged)
    (True, True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from ._pcg import restricted_product
from ._projected import Plan, bfloat16_bulk, outer_pairs
from ._thin_product import thin_product

_norm = torch.linalg.vector_norm

#: Step cap of one float32 correction solve.
MIXED_MAX_STEPS = 16
#: A float32 solve stops once its (recurrence) residual is this fraction of the target: the
#: float64 residual of the new point is above it by the float32 rounding.
MIXED_MARGIN = 0.5
#: A tight round whose float64 residual did not fall below this fraction of the last one
#: stalled (float32 cannot resolve the correction: ``κ·eps₃₂`` near 1).
STALL_RATIO = 0.1
#: The float32 steps take their product in bfloat16 (on the bulk, the outliers' part apart)
#: once every row's residual is within this factor of its target: an inexact product of
#: relative error ``η`` keeps conjugate gradients' attainable accuracy while ``η ‖r‖``
#: stays below the target (Simoncini & Szyld 2003, van den Eshof & Sleijpen 2004), and
#: bfloat16's ``η`` is about ``2⁻⁸``; half of that for a margin.
RELAXED_WITHIN = 128.0
#: Finished rows are dropped from the float32 steps once they are this fraction of them
#: (until then parked: a gather of every tensor costs more than their products).
DROP_FRACTION = 1 / 2


class Rough(NamedTuple):
    """``Q = bulk + left·right`` (``bulk`` in bfloat16; ``left`` ``[K, m]``, ``right``
    ``[m, K]`` in float32, None without outliers): :func:`_product`'s operands."""

    bulk: Tensor
    left: Tensor | None = None
    right: Tensor | None = None


@dataclass(frozen=True)
class ScaledPreconditioner:
    """``M⁻¹ = S (I + U diag(c) Uᵀ)⁻¹ S`` restricted to each free set: ``scale`` ``[K]``
    (``S``'s diagonal), ``v`` ``[K, m]`` orthonormal and ``c`` ``[m]`` (None: ``S²``, Jacobi),
    float32."""

    scale: Tensor
    v: Tensor | None
    c: Tensor | None

    @classmethod
    def of(cls, start: Plan) -> ScaledPreconditioner:
        """The preconditioner of the projected start ``start`` (its scaling and outliers)."""
        scale = start.scale.float()
        if start.v is None:
            return cls(scale, None, None)
        v = start.v.float()
        v = v[:, None] if v.dim() == 1 else v
        c = torch.as_tensor(start.c, dtype=torch.float32).reshape(-1)
        return cls(scale, v, c)

    def setup(self, f: Tensor) -> Tensor | None:
        """``(diag(1/c) + U_FᵀU_F)⁻¹`` ``[B, m, m]`` of the free sets ``f`` (0/1, float32)."""
        if self.v is None or self.c is None:
            return None
        m = self.v.shape[1]
        small = (f @ outer_pairs(self.v)).view(-1, m, m)
        small.diagonal(dim1=1, dim2=2).add_(1.0 / self.c)
        inverse: Tensor = torch.linalg.inv_ex(small).inverse
        return inverse

    def bulk(self, q32: Tensor) -> Rough:
        """``Q = B + W diag(c) Wᵀ`` with ``B`` in bfloat16 and ``W = S⁻¹U`` the outliers in
        ``Q``'s own coordinates (``SQS ≈ I + U diag(c) Uᵀ``; none: ``B = Q``), for products
        whose rounding is relative to the bulk (the outliers' part is taken in float32)."""
        if self.v is None or self.c is None:
            return Rough(bfloat16_bulk(q32, None, 0.0))
        w = self.v / self.scale[:, None]
        return Rough(bfloat16_bulk(q32, w, self.c), w * self.c, w.T.contiguous())


    def apply(self, r: Tensor, f: Tensor, small: Tensor | None,
              out: Tensor | None = None) -> Tensor:
        """``M⁻¹ r`` per row (``r`` zero off ``F``; ``small`` from :meth:`setup`), in ``out``
        where given."""
        rt = torch.mul(r, self.scale, out=torch.empty_like(r) if out is None else out)
        if self.v is not None and small is not None:
            coef = torch.bmm(small, thin_product(rt, self.v)[:, :, None])[:, :, 0]
            rt.addmm_(coef, self.v.T, alpha=-1.0).mul_(f)  # zero off F again
        return rt.mul_(self.scale)


class MixedSolve(NamedTuple):
    """:func:`mixed_free_solve`'s answer: ``y`` and ``yq = yQ`` (float64, exact products),
    whether each row's residual met its target, and whether a row's round stalled."""

    y: Tensor
    converged: Tensor
    yq: Tensor
    stalled: Tensor


def mixed_free_solve(q: Tensor, q32: Tensor, pre: ScaledPreconditioner, shift: Tensor,
                     free: Tensor, y0: Tensor, y0q: Tensor, target: Tensor,
                     max_steps: int = MIXED_MAX_STEPS,
                     rough: Rough | None = None) -> MixedSolve:
    """One round of refinement on the free sets: ``Q_FF y_F = −shift_F`` per row (``[B, K]``,
    ``y`` zero off ``F``) from ``y0`` (``y0q = y0 Q``, exact; ``y0`` is updated in place where
    it is zero off ``F``), to the residual ``target``
    ``[B]`` where one round reaches it; ``q32``: ``Q`` in float32. Two float64 products at
    most (the start restricted to ``F`` where it is not already, and the new point) and
    float32 steps in between (:func:`~._pcg.restricted_product`: the entries the free set
    drops are subtracted, a sparse product where they are few). ``rough``: the bulk in
    bfloat16 and the outliers (:meth:`ScaledPreconditioner.bulk`) for the last float32
    steps (``RELAXED_WITHIN``)."""
    f = free.to(q.dtype)
    moved = bool((y0.ne(0.0) & ~free).any())  # entries the free set drops: their product off
    y = y0 * f if moved else y0  # y0 is written to where it is zero off F already
    yq = restricted_product(q, y0, y0q, f, y) if moved else y0q  # y0q is not written to
    res = torch.add(shift, yq).mul_(f)  # minus the residual: yQ + shift on F
    before = _norm(res, dim=1)
    todo = before > target
    count = int(todo.sum())
    if count == 0:
        return MixedSolve(y, torch.ones_like(todo), yq, todo)
    if count == todo.numel():  # every row: no gathers
        y += _float32_solve(q32, pre, res.float().neg_(), free.float(), MIXED_MARGIN * target,
                            max_steps, rough)
        yq = y @ q
    else:
        rows = torch.nonzero(todo).flatten()
        d = _float32_solve(q32, pre, res.index_select(0, rows).float().neg_(),
                           free.index_select(0, rows).float(), MIXED_MARGIN * target[rows],
                           max_steps, rough)
        y.index_add_(0, rows, d.to(q.dtype))
        yq = yq.index_copy(0, rows, y.index_select(0, rows) @ q)
    after = _norm(torch.add(shift, yq, out=res).mul_(f), dim=1)
    stalled = todo & (after > STALL_RATIO * before)
    return MixedSolve(y, after <= target, yq, stalled)


def _float32_solve(q32: Tensor, pre: ScaledPreconditioner, r: Tensor, f: Tensor,
                   target: Tensor, max_steps: int,
                   rough: Rough | None = None) -> Tensor:
    """``d`` ``[B, K]`` with ``Q_FF d_F ≈ r_F`` per row (float32 conjugate gradients,
    preconditioned by ``pre``, from 0), each row until its recurrence residual is at most
    ``target`` or ``max_steps`` steps; finished rows are dropped once they are
    ``DROP_FRACTION`` of those left; with ``rough`` (:meth:`ScaledPreconditioner.bulk`),
    the products in bfloat16 once every residual is within ``RELAXED_WITHIN`` of its
    target (:func:`_product`)."""
    d = torch.zeros_like(r)
    live = torch.arange(r.shape[0])
    small = pre.setup(f)
    goal = target.float()
    p = pre.apply(r, f, small)
    rz = torch.linalg.vecdot(r, p)
    x = d  # the live rows' corrections (``d`` itself until rows are dropped)
    # the product and the next direction in two buffers that turn over: a fresh tensor per
    # step costs its pages' first touch (:func:`~._projected.fista`)
    pq, z = torch.empty_like(r), torch.empty_like(r)
    relaxed = None  # the bulk's product, once relaxed
    for _ in range(max_steps):
        _product(p, q32, relaxed, pq)
        pap = torch.linalg.vecdot(p, pq)
        alpha = torch.where(pap > 0, rz / torch.where(pap > 0, pap, 1.0), 0.0)[:, None]
        x.addcmul_(alpha, p)
        r.addcmul_(pq.mul_(f), alpha, value=-1.0)
        size = _norm(r, dim=1)
        stop = (size <= goal) | (pap <= 0)
        relaxed = relaxed or _relaxed(rough, size, goal)
        if bool(stop.all()):
            break
        if bool(stop.any()) and float(stop.sum()) >= DROP_FRACTION * live.numel():
            if x is not d:
                d.index_copy_(0, live, x)
            keep = torch.nonzero(~stop).flatten()
            live, x, r, f, p, rz, goal, pq, z = (
                t.index_select(0, keep) for t in (live, x, r, f, p, rz, goal, pq, z))
            small = None if small is None else small.index_select(0, keep)
        elif bool(stop.any()):
            _park(stop, r, p)
        z = pre.apply(r, f, small, out=z)
        rz_new = torch.linalg.vecdot(r, z)
        beta = torch.where(rz > 0, rz_new / torch.where(rz > 0, rz, 1.0), 0.0)[:, None]
        p, z = z.addcmul_(p, beta), p
        rz = rz_new
    if x is not d:
        d.index_copy_(0, live, x)
    return d


def _relaxed(rough: Rough | None, size: Tensor, goal: Tensor) -> Rough | None:
    """``rough`` where every residual ``size`` is within ``RELAXED_WITHIN`` of its target,
    else None."""
    if rough is None or not bool((size <= RELAXED_WITHIN * goal).all()):
        return None
    return rough


def _park(stop: Tensor, r: Tensor, p: Tensor) -> None:
    """The rows ``stop`` parked in place: a zero residual and direction leave their point
    where it is (a gather of every tensor costs more than their products)."""
    idx = torch.nonzero(stop).flatten()
    r.index_fill_(0, idx, 0.0)
    p.index_fill_(0, idx, 0.0)


def _product(p: Tensor, q32: Tensor, rough: Rough | None, out: Tensor) -> None:
    """``pQ`` into ``out``: in float32, or with ``rough`` as ``p·bulk`` in bfloat16 plus the
    outliers' ``(p·left)·right`` in float32."""
    if rough is None:
        torch.matmul(p, q32, out=out)
        return
    out.copy_(p.bfloat16() @ rough.bulk)
    if rough.left is not None and rough.right is not None:
        out.addmm_(thin_product(p, rough.left), rough.right)
