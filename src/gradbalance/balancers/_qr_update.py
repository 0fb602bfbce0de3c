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

``T`` is kept transposed and in the order of ``A``'s columns (no row ever moves): a
factorised column's row is zero beyond its place, exactly, so the reflections and
rotations applied to every row leave it there, and a step is a handful of whole-matrix
operations, whatever the column.

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
    ``p = size`` rows; ``A`` ``[m, n]``, ``b`` ``[m]``, float64.

    ``T`` is stored transposed (``tt`` ``[n + 1, m]``, row ``j`` for column ``j`` of ``A``,
    row ``n`` for ``b``): the factorised column at place ``i`` has its row zero beyond
    entry ``i``, so ``Rᵀ`` is ``tt[cols, :p]``; ``order[:p]`` holds ``cols`` as a tensor.
    """

    def __init__(self, a: Tensor, b: Tensor) -> None:
        self.n = a.shape[1]
        self.tt = torch.cat([a.T, b[None]]).contiguous()
        self.cols: list[int] = []  # the factorised columns, in their order
        self.order = torch.arange(self.n)  # order[:size] = cols
        self.size = 0

    @property
    def cols_t(self) -> Tensor:
        """:attr:`cols` as an index tensor (a view: valid until the next change)."""
        return self.order[: self.size]

    def off_norms(self) -> Tensor:
        """``[n]``: each column's distance to the span of the factorised ones (zero for
        the factorised ones)."""
        off: Tensor = _norm(self.tt[: self.n, self.size :], dim=1)
        return off

    def off_norm(self, j: int) -> float:
        """Column ``j``'s distance to the span of the factorised ones."""
        return float(_norm(self.tt[j, self.size :]))

    def residual_norm(self) -> float:
        """``‖A_cols z − b‖`` at the solution ``z`` of :meth:`solve`."""
        return float(_norm(self.tt[self.n, self.size :]))

    def add(self, j: int) -> None:
        """Column ``j`` joins (last): one Householder reflection of columns ``p:`` of every
        row. The caller makes sure ``j`` is off the span (``off_norm(j) > 0``)."""
        p = self.size
        tail = self.tt[:, p:]  # rows of the factorised columns: zero here, and stay so
        v = tail[j].clone()
        x0 = float(v[0])
        alpha = float(_norm(v))
        if x0 > 0.0:
            alpha = -alpha
        v[0] = x0 - alpha  # v = x − αe₁ with α of the opposite sign of x₀: no cancellation
        vv = 2.0 * alpha * (alpha - x0)  # ‖v‖² = ‖x‖² − 2αx₀ + α², ‖x‖² = α²
        if vv > 0.0:
            tail.addr_(tail @ v, v, alpha=-2.0 / vv)
        tail[j, 0] = alpha
        tail[j, 1:] = 0.0
        self.order[p] = j
        self.cols.append(j)
        self.size = p + 1

    def add_block(self, js: list[int]) -> None:
        """The columns ``js`` join (last, in order): one blocked Householder factorisation
        of their part off the span (``geqrf``), applied to every row (``ormqr``). The caller
        makes sure each is off the span of those before it (:meth:`diagonal`)."""
        p, s = self.size, len(js)
        tail = self.tt[:, p:]
        idx = torch.tensor(js)
        refl, tau = torch.geqrf(tail[idx].T)
        tail.copy_(torch.ormqr(refl, tau, tail, left=False, transpose=False))
        tail[idx] = tail[idx].tril()  # under the diagonal: rounding, made zero
        self.order[p : p + s] = idx
        self.cols.extend(js)
        self.size = p + s

    def truncate(self, size: int) -> None:
        """The columns placed from ``size`` on leave (no rotation: they are the last)."""
        del self.cols[size:]
        self.size = size

    def diagonal(self, start: int) -> Tensor:
        """``|R_ii|`` for the places ``i ≥ start``: each column's distance to the span of
        those placed before it."""
        p = self.size
        return self.tt[self.order[start:p], start:p].diagonal().abs()

    def drop(self, j: int) -> None:
        """Column ``j`` leaves: the columns behind it move one place forward, one row below
        the diagonal, and are rotated back onto it by blocks of ``BLOCK`` rows."""
        i, p = self.cols.index(j), self.size
        del self.cols[i]
        self.order[i:p] = self.order[i:p].roll(-1, 0)
        self.size = p - 1
        for k in range(i, p - 1, BLOCK):
            h = min(BLOCK, p - 1 - k)
            rows = self.order[k : k + h]
            span = self.tt[:, k : k + h + 1]
            q = torch.linalg.qr(span[rows].T, mode="complete").Q
            span.copy_(span @ q)
            span[rows] = span[rows].tril()  # under the diagonal: rounding, made zero

    def solve(self) -> Tensor:
        """``z`` ``[p]`` (in the order of ``cols``) minimising ``‖A_cols z − b‖``."""
        p = self.size
        r_t = self.tt[:, :p].index_select(0, self.order[:p])  # Rᵀ
        z: Tensor = torch.linalg.solve_triangular(
            r_t.T, self.tt[self.n, :p, None], upper=True)[:, 0]
        return z
