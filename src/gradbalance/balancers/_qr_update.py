"""A QR factorisation of a changing set of columns of ``A``, updated instead of recomputed.

Not a balancer module (no ``__all__``). Lawson–Hanson's active set (:func:`~._boxqp.nnls`)
adds or removes one column of its passive set per step; a factorisation from scratch per
step costs ``O(m p²)``, plus ``O(m p n)`` to measure every other column against the passive
ones. :class:`ColumnQR` keeps ``T = Hᵀ[A | b]`` for an orthogonal ``H`` (Golub & Van Loan,
*Matrix Computations*, 4th ed., §5.1 and §6.5.2): the passive columns, in their order, are
upper triangular in ``T``'s first ``p`` rows, so

* the least-squares solution on them is one triangular solve (``O(p²)``);
* column ``j``'s distance to their span is ``‖T[p:, j]‖`` (no cancellation);
* a column enters with one Householder reflection of rows ``p:`` (``O(m n)``), and one
  leaves with the Givens rotations that restore the triangle behind it (``O(p n)``).

Example:
    >>> import torch
    >>> from gradbalance.balancers._qr_update import ColumnQR
    >>> a = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]], dtype=torch.float64)
    >>> qr = ColumnQR(a, torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    >>> qr.add(1); qr.add(0)  # b's projection on their span: −1·a₀ + 2·a₁
    >>> qr.solve().round(decimals=12)
    tensor([ 2., -1.], dtype=torch.float64)
    >>> qr.drop(1)  # a₀ alone; a₁'s part off its span: (0, 1, 0)
    >>> qr.off_norms().round(decimals=12)
    tensor([0., 1.], dtype=torch.float64)
"""

from __future__ import annotations

import torch
from torch import Tensor

_norm = torch.linalg.vector_norm


#: Rows re-triangularised per block when a column leaves: each block is one small QR and
#: one product with ``T``'s rows (a few tensor operations in place of one per rotation).
BLOCK = 24


class ColumnQR:
    """``T = Hᵀ[A | b]`` with the columns ``cols`` (in order) upper triangular in its first
    ``p = len(cols)`` rows; ``A`` ``[m, n]``, ``b`` ``[m]``, float64.

    ``T``'s columns are stored permuted, the factorised ones first, so that ``R`` is the
    leading ``p × p`` block; ``b`` is the last column.
    """

    def __init__(self, a: Tensor, b: Tensor) -> None:
        self.n = a.shape[1]
        self.t = torch.cat([a, b[:, None]], dim=1)
        self.perm = list(range(self.n))  # stored position → column of A
        self.where = list(range(self.n))  # column of A → stored position
        self.size = 0

    @property
    def cols(self) -> list[int]:
        """The factorised columns, in their order."""
        return self.perm[: self.size]

    def off_norms(self) -> Tensor:
        """``[n]``: each column's distance to the span of the factorised ones."""
        off = _norm(self.t[self.size :, : self.n], dim=0)
        out: Tensor = off[torch.tensor(self.where)]
        return out

    def off_norm(self, j: int) -> float:
        """Column ``j``'s distance to the span of the factorised ones."""
        return float(_norm(self.t[self.size :, self.where[j]]))

    def _move(self, start: int, order: list[int]) -> None:
        """The stored columns from ``start`` on take the columns of ``A`` in ``order``."""
        stop = start + len(order)
        self.t[:, start:stop] = self.t[:, [self.where[j] for j in order]]
        self.perm[start:stop] = order
        for q, j in enumerate(order, start):
            self.where[j] = q

    def add(self, j: int) -> None:
        """Column ``j`` joins (last): one Householder reflection of rows ``p:`` of ``T``.
        The caller makes sure ``j`` is off the span (``off_norm(j) > 0``)."""
        p, q = self.size, self.where[j]
        if q != p:  # swap the stored columns p and q
            self.t[:, [p, q]] = self.t[:, [q, p]]
            self.perm[p], self.perm[q] = j, self.perm[p]
            self.where[self.perm[q]], self.where[j] = q, p
        rows = self.t[p:]
        v = rows[:, p].clone()
        alpha = float(_norm(v))
        if float(v[0]) > 0.0:
            alpha = -alpha
        v[0] -= alpha  # v = x − αe₁ with α of the opposite sign of x₀: no cancellation
        vv = float(v @ v)
        if vv > 0.0:
            rows.addr_(v, v @ rows, alpha=-2.0 / vv)
        rows[0, p] = alpha
        rows[1:, p] = 0.0
        self.size = p + 1

    def drop(self, j: int) -> None:
        """Column ``j`` leaves: the columns behind it move one place forward, one row below
        the diagonal, and are rotated back onto it by blocks of ``BLOCK`` rows."""
        i, p = self.where[j], self.size
        self._move(i, [*self.perm[i + 1 : p], j])
        self.size = p - 1
        for k in range(i, p - 1, BLOCK):
            end = min(k + BLOCK, p - 1)
            rows = self.t[k : end + 1, k:]
            q = torch.linalg.qr(rows[:, : end - k], mode="complete").Q
            rows.copy_(q.T @ rows)
            below = rows[1:, : end - k]
            below.copy_(torch.triu(below, 1))

    def solve(self) -> Tensor:
        """``z`` ``[p]`` (in the order of ``cols``) minimising ``‖A_cols z − b‖``."""
        p = self.size
        z: Tensor = torch.linalg.solve_triangular(
            self.t[:p, :p], self.t[:p, self.n :], upper=True)[:, 0]
        return z

    def residual_norm(self) -> float:
        """``‖A_cols z − b‖`` at that solution."""
        return float(_norm(self.t[self.size :, self.n]))
