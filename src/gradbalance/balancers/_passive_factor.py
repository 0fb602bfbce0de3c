"""The Cholesky factors of many problems' passive blocks of one ``Q``, updated per addition.

Not a balancer module (no ``__all__``). For each of ``B`` problems with passive indices
``P`` (in the order they entered): ``C`` lower triangular with ``C Cᵀ = Q_PP``,
``W = C⁻¹ Q_P:`` ``[m, K]``, ``h = C⁻¹ rhs_P`` and ``sⱼ = Qⱼⱼ − ‖W_:ⱼ‖²``, the squared
distance of column ``j`` of ``Lᵀ`` (``Q = L Lᵀ``) from the span of the passive ones. An
entering index ``t`` needs no new factorisation: its row of ``C`` is ``W_:t`` and its
diagonal ``√sₜ`` (the left-looking Cholesky step), so the solve on ``P ∪ {t}`` is one
triangular solve and the addition one ``[m] × [m, K]`` product per problem, ``O(mK)``
instead of the ``O(m²K + m³)`` of factorising the blocks afresh (Golub & Van Loan 2013,
*Matrix Computations*, §4.2 and §6.5.4). A leaving index is deleted by Givens rotations
(``O(mK)``, §6.5.2), or its problem refactorised while the passive sets are small.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._cholesky import cholesky_ex

#: Up to this many passive indices a removal refactorises (``O(m²K)``, few operations);
#: above, each leaving index is deleted by Givens rotations (``O(mK)``, ``m`` steps).
DOWNDATE_MIN_SIZE = 24
#: Most multiply-adds (``n m² K`` for ``n`` problems) a removal refactorises above
#: ``DOWNDATE_MIN_SIZE``: the ``m`` rotation steps' fixed cost per step is larger below.
REFACTOR_MAX_WORK = 2**23


class Block(NamedTuple):
    """``b`` indices entering each of ``B`` problems together: ``t`` ``[B, b]``, the
    Cholesky factor ``low`` ``[B, b, b]`` of their Schur complement on the passive block,
    the new entries ``h`` ``[B, b]`` of ``h`` and ``cross`` ``[B, b, m]`` (their columns of
    ``W``: the new rows of ``C`` left of ``low``)."""

    t: Tensor
    low: Tensor
    h: Tensor
    cross: Tensor


def _tri_solve_upper(chol: Tensor, h: Tensor) -> Tensor:
    """``z`` ``[B, m]`` with ``Cᵀ z = h`` (``chol`` ``[B, m, m]`` lower triangular)."""
    z: Tensor = torch.linalg.solve_triangular(chol.mT, h[..., None], upper=True)
    return z[..., 0]


def _rotate(x: Tensor, y: Tensor, cs: Tensor, sn: Tensor) -> None:
    """``(x, y) ← (cs x + sn y, cs y − sn x)`` in place (a Givens rotation of two rows)."""
    new = cs * x + sn * y
    y.mul_(cs).sub_(sn * x)
    x.copy_(new)


class PassiveFactor:
    """The factors of ``B`` problems' passive blocks of ``q`` ``[K, K]`` with right-hand sides
    ``rhs`` ``[B, K]``: ``order`` ``[B, cap]`` (passive indices in order, ``count`` of them),
    ``h`` ``[B, cap]`` (zero past ``count``), ``off`` ``[B, K]`` (``sⱼ``); ``chol``
    ``[S, cap, cap]`` (the identity past ``count``) and ``w`` ``[S, cap, K]`` (zero past
    ``count``) in storage rows ``slot`` ``[B]``, compacted only once half of them are
    finished (the largest arrays are not copied on every step)."""

    def __init__(self, q: Tensor, rhs: Tensor) -> None:
        b, k = rhs.shape
        self.q, self.rhs = q, rhs
        self.diag = torch.diagonal(q).clamp_min(0.0)
        self.count = torch.zeros(b, dtype=torch.int64)
        self.order = torch.zeros(b, 0, dtype=torch.int64)
        self.chol = torch.zeros(b, 0, 0, dtype=q.dtype)
        self.w = torch.zeros(b, 0, k, dtype=q.dtype)
        self.h = torch.zeros(b, 0, dtype=q.dtype)
        self.off = self.diag.expand(b, k).clone()
        self.slot = torch.arange(b)

    def keep(self, mask: Tensor) -> None:
        """Only the problems where ``mask`` stay."""
        if bool(mask.all()):
            return
        for name in ("rhs", "count", "order", "h", "off", "slot"):
            setattr(self, name, getattr(self, name)[mask])
        if 2 * self.slot.numel() <= self.w.shape[0]:
            self.chol, self.w = self.chol[self.slot], self.w[self.slot]
            self.slot = torch.arange(self.slot.numel())

    def _grow(self, size: int) -> None:
        """Room for ``size`` passive indices per problem."""
        cap = self.order.shape[1]
        if size <= cap:
            return
        new = max(size, 2 * cap, 8)
        b, k = self.off.shape
        order = torch.zeros(b, new, dtype=torch.int64)
        order[:, :cap] = self.order
        chol = torch.eye(new, dtype=self.q.dtype).repeat(self.w.shape[0], 1, 1)
        chol[:, :cap, :cap] = self.chol
        w = torch.zeros(self.w.shape[0], new, k, dtype=self.q.dtype)
        w[:, :cap] = self.w
        h = torch.zeros(b, new, dtype=self.q.dtype)
        h[:, :cap] = self.h
        self.order, self.chol, self.w, self.h = order, chol, w, h

    def scatter(self, sel: Tensor, z: Tensor) -> Tensor:
        """``[len(sel), K]`` from the problems ``sel``'s values ``[·, m]`` in passive order
        (zero off the passive sets)."""
        m = z.shape[1]
        valid = torch.arange(m)[None, :] < self.count[sel, None]
        out = torch.zeros(sel.shape[0], self.off.shape[1], dtype=z.dtype)
        return out.scatter_add_(1, self.order[sel, :m], torch.where(valid, z, 0.0))

    def solve(self, sel: Tensor) -> Tensor:
        """``z`` ``[len(sel), K]``: ``Q_PP z_P = rhs_P`` for the problems ``sel``, zero off
        ``P``."""
        m = int(self.count[sel].max()) if sel.numel() else 0
        if m == 0:
            return torch.zeros(sel.shape[0], self.off.shape[1], dtype=self.q.dtype)
        chol = self.chol[self.slot[sel], :m, :m]
        return self.scatter(sel, _tri_solve_upper(chol, self.h[sel, :m]))

    def try_add(self, t: Tensor, min_schur: Tensor,
                sel: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """``(z, root, hₜ)``: the solve on ``P ∪ {tᵦ}`` ``[B, K]`` for the problems ``sel``
        (default all; NaN where ``sₜ`` is not above ``min_schur``), ``√sₜ`` and the new entry
        of ``h``; nothing is stored."""
        rows = torch.arange(t.shape[0]) if sel is None else sel
        local = torch.arange(t.shape[0])
        m = int(self.count[rows].max()) if rows.numel() else 0
        slot = self.slot[rows]
        schur = self.off[rows, t]
        ok = schur > min_schur
        root = torch.where(ok, schur, 1.0).sqrt()
        c = self.w[slot, :m, t]  # zero past each problem's count
        h_t = (self.rhs[rows, t] - (c * self.h[rows, :m]).sum(dim=1)) / root
        z_t = h_t / root
        z = self.off.new_zeros(t.shape[0], self.off.shape[1])
        if m:
            z = self.scatter(rows, _tri_solve_upper(self.chol[slot, :m, :m],
                                                    self.h[rows, :m] - c * z_t[:, None]))
        z[local, t] = z_t
        return z.masked_fill_(~ok[:, None], torch.nan), root, h_t

    def add(self, sel: Tensor, t: Tensor, root: Tensor, h_t: Tensor) -> None:
        """``tᵦ`` enters the problems ``sel`` (``√sₜ`` and ``hₜ`` from :meth:`try_add`)."""
        m = int(self.count[sel].max()) if sel.numel() else 0
        self._grow(m + 1)
        slot = self.slot[sel]
        c = self.w[slot, :m, t]
        pos = self.count[sel]
        self.chol[slot, pos, :m] = c
        self.chol[slot, pos, pos] = root
        spread = torch.zeros(self.w.shape[0], 1, m, dtype=c.dtype)
        spread[slot, 0] = c  # the product on the stored rows: no copy of w
        new = (self.q[t] - torch.bmm(spread, self.w[:, :m])[slot, 0]) / root[:, None]
        self.w[slot, pos] = new
        self.h[sel, pos] = h_t
        self.order[sel, pos] = t
        self.off[sel] -= new * new
        self.count[sel] = pos + 1

    def try_block(self, sel: Tensor, t: Tensor, min_schur: Tensor) -> tuple[Tensor, Tensor, Block]:
        """``(z, ok, block)`` for the problems ``sel`` and ``t`` ``[n, b]`` entering in order:
        ``z`` ``[n, b, K]``, the solve on ``P`` and the first ``j + 1`` of ``t`` (zero
        elsewhere), ``ok`` ``[n, b]`` where each of their Schur complements (the block's
        left-looking Cholesky step) is above ``min_schur`` (the test of single additions in
        turn), and the block's new rows of the factor; nothing is stored."""
        n, b = t.shape
        m = int(self.count[sel].max())
        slot = self.slot[sel]
        cross = self.w[slot[:, None], :m, t]  # [n, b, m]: zero past each count
        low, info = cholesky_ex(self.q[t[:, :, None], t[:, None, :]] - cross @ cross.mT)
        pivots = low.diagonal(dim1=1, dim2=2)
        ar = torch.arange(b)
        ok = ((pivots * pivots > min_schur) & ((info[:, None] == 0) | (ar < info[:, None] - 1)))
        ok = ok.cumprod(dim=1).bool()
        h = self.h[sel, :m]
        rhs = self.rhs[sel[:, None], t] - (cross @ h[..., None])[..., 0]
        h_t = torch.linalg.solve_triangular(low, rhs[..., None], upper=False)[..., 0]
        prefix = (ar[None, :, None] <= ar[:, None, None]) & (ar[None, None, :] <= ar[:, None, None])
        eye = torch.eye(b, dtype=low.dtype)
        lows = torch.where(prefix, low[:, None], eye)  # [n, j, b, b]: the leading j + 1
        z_t = _tri_solve_upper(lows, torch.where(prefix[:, :, 0], h_t[:, None], 0.0))
        z = self.off.new_zeros(n, b, self.off.shape[1])
        if m:
            rest = h[:, None] - z_t @ cross  # [n, j, m]
            zp = torch.linalg.solve_triangular(self.chol[slot, :m, :m].mT, rest.mT, upper=True)
            z.scatter_add_(2, self.order[sel, None, :m].expand(-1, b, -1),
                           torch.where(torch.arange(m) < self.count[sel, None, None], zp.mT, 0.0))
        z.scatter_add_(2, t[:, None].expand(-1, b, -1), z_t)
        return z, ok, Block(t, low, h_t, cross)

    def add_block(self, sel: Tensor, size: Tensor, block: Block) -> None:
        """The problems ``sel`` take the first ``size`` ``[n]`` indices of their blocks
        (:meth:`try_block`, one row each): rows ``[X L]`` of ``C``, ``W_T = L⁻¹ (Q_T: − X W)``
        and ``h_T`` (Golub & Van Loan 2013, §4.2: the block form of :meth:`add`)."""
        t, low, h_t, cross = block
        b, m = t.shape[1], cross.shape[2]
        self._grow(int(self.count[sel].max()) + b)
        slot, pos = self.slot[sel], self.count[sel]
        spread = torch.zeros(self.w.shape[0], b, m, dtype=cross.dtype)
        spread[slot] = cross  # the product on the stored rows: no copy of w
        new = torch.linalg.solve_triangular(
            low, self.q[t] - torch.bmm(spread, self.w[:, :m])[slot], upper=False)
        i, r = torch.nonzero(torch.arange(b)[None, :] < size[:, None], as_tuple=True)
        at = pos[i] + r
        self.chol[slot[i], at, :m] = cross[i, r]  # zero from each count on
        self.chol[slot[i, None], at[:, None], pos[i, None] + torch.arange(b)] = low[i, r]
        self.w[slot[i], at] = new[i, r]
        self.h[sel[i], at] = h_t[i, r]
        self.order[sel[i], at] = t[i, r]
        kept = (torch.arange(b) < size[:, None])[..., None]
        self.off[sel] -= torch.where(kept, new * new, 0.0).sum(dim=1)
        self.count[sel] = pos + size

    def remove(self, sel: Tensor, passive: Tensor) -> None:
        """The problems ``sel`` take the passive sets ``passive`` ``[len(sel), K]`` (subsets
        of theirs, the order kept): factorised afresh up to ``DOWNDATE_MIN_SIZE`` indices
        or ``REFACTOR_MAX_WORK`` multiply-adds,
        else each leaving index deleted from the factors (:meth:`_delete`)."""
        top = int(self.count[sel].max())
        work = sel.numel() * top * top * self.q.shape[0]
        if top <= DOWNDATE_MIN_SIZE or work <= REFACTOR_MAX_WORK:
            self._refactor(sel, passive)
            return
        while True:
            before = self.order[sel, :top]
            gone = ((torch.arange(top)[None, :] < self.count[sel, None])
                    & ~passive.gather(1, before))
            has = gone.any(dim=1)
            if not bool(has.any()):
                return
            self._delete(sel[has], gone[has].to(torch.int8).argmax(dim=1))

    def _delete(self, sel: Tensor, p: Tensor) -> None:
        """The index at position ``pᵦ`` leaves each problem ``sel``: its row of ``C`` goes,
        Givens rotations of columns ``j, j+1`` (``j ≥ p``) make the rest triangular again and
        rotate rows ``j, j+1`` of ``W`` and ``h`` alike (``C W`` is kept), and the last row of
        ``W`` leaves, its squares added back to ``s`` (Golub & Van Loan 2013, §6.5.2)."""
        slot, cnt = self.slot[sel], self.count[sel]
        m = int(cnt.max())
        n = sel.shape[0]
        ar = torch.arange(m - 1)[None, :]
        src = ar + (ar >= p[:, None]).long()  # the rows kept, in order
        rows = self.chol[slot, :m, :m].gather(1, src[..., None].expand(-1, -1, m))
        cols = rows.transpose(1, 2).contiguous()  # cols[:, j]: column j, its rows contiguous
        w, h = self.w[slot, :m], self.h[sel, :m]  # gathered: copies
        for j in range(int(p.min()), m - 1):
            act = (p <= j) & (j < cnt - 1)
            a, b = cols[:, j, j], cols[:, j + 1, j]
            rad = torch.hypot(a, b)
            act &= rad > 0
            cs = torch.where(act, a / torch.where(act, rad, 1.0), 1.0)
            sn = torch.where(act, b / torch.where(act, rad, 1.0), 0.0)
            # rows above j are zero in both columns (one row of a triangle deleted): skipped
            _rotate(cols[:, j, j:], cols[:, j + 1, j:], cs[:, None], sn[:, None])
            _rotate(w[:, j], w[:, j + 1], cs[:, None], sn[:, None])
            _rotate(h[:, j], h[:, j + 1], cs, sn)
        rows_in, last = torch.arange(n), cnt - 1
        self.off[sel] += w[rows_in, last] ** 2
        w[rows_in, last], h[rows_in, last] = 0.0, 0.0
        vf = (torch.arange(m)[None, :] < last[:, None]).to(cols.dtype)
        chol = torch.nn.functional.pad(cols.transpose(1, 2)[:, :, : m - 1], (0, 1, 0, 1))
        chol.mul_(vf[:, :, None]).mul_(vf[:, None, :]).diagonal(dim1=1, dim2=2).add_(1.0 - vf)
        self.chol[slot, :m, :m] = chol
        self.w[slot, :m], self.h[sel, :m] = w, h
        order = torch.nn.functional.pad(self.order[sel, :m].gather(1, src), (0, 1))
        self.order[sel, :m] = torch.where(vf > 0, order, 0)
        self.count[sel] = last

    def _refactor(self, sel: Tensor, passive: Tensor) -> None:
        """:meth:`remove` by a fresh factorisation of the passive blocks."""
        top = int(self.count[sel].max())  # the rows in use before: cleared past m
        before = self.order[sel, :top]
        valid = (torch.arange(top)[None, :] < self.count[sel, None]) & passive.gather(1, before)
        count = valid.sum(dim=1)
        m = int(count.max())
        first = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)[:, :m]
        order = before.gather(1, first)  # the kept indices, in their order
        vf = (torch.arange(m)[None, :] < count[:, None]).to(self.q.dtype)
        mask = vf[:, :, None] * vf[:, None, :]
        eye = torch.diag_embed(1.0 - vf)
        block = self.q[order].gather(2, order[:, None, :].expand(-1, m, m))
        chol = cholesky_ex(block * mask + eye)[0] * mask + eye
        w = torch.linalg.solve_triangular(chol, self.q[order] * vf[:, :, None], upper=False)
        h = torch.linalg.solve_triangular(
            chol, (self.rhs[sel].gather(1, order) * vf)[..., None], upper=False)[..., 0]
        slot = self.slot[sel]
        self.chol[slot, :top, :top] = torch.nn.functional.pad(chol, (0, top - m, 0, top - m))
        if top > m:
            self.chol[slot, m:top, m:top] = torch.eye(top - m, dtype=self.q.dtype)
        self.w[slot, :top] = torch.nn.functional.pad(w, (0, 0, 0, top - m))
        self.h[sel, :top] = torch.nn.functional.pad(h, (0, top - m))
        self.order[sel, :top] = torch.nn.functional.pad(order * vf.long(), (0, top - m))
        self.count[sel] = count
        self.off[sel] = self.diag - (w * w).sum(dim=1)
