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
    ``p = size`` rows; ``A`` ``[m, n]``, ``b`` ``[m]``, float64.

    ``T`` is stored transposed (``tt``, one row per column of ``[A | b]``: a column's
    distance and a triangular solve read contiguous memory), its columns permuted so that the
    factorised ones come first (``R`` is the leading ``p × p`` block); ``perm_t`` maps a stored
    place to its column of ``A``.
    """

    def __init__(self, a: Tensor, b: Tensor) -> None:
        self.n = a.shape[1]
        self.tt = torch.cat([a.T, b[None]]).contiguous()
        self.perm = list(range(self.n))  # stored place → column of A
        self.where = list(range(self.n))  # column of A → stored place
        self.perm_t = torch.arange(self.n)
        self.size = 0

    @property
    def cols(self) -> list[int]:
        """The factorised columns, in their order."""
        return self.perm[: self.size]

    @property
    def cols_t(self) -> Tensor:
        """:attr:`cols` as an index tensor."""
        return self.perm_t[: self.size].clone()

    def to_columns(self, stored: Tensor) -> Tensor:
        """A vector ``[n]`` in stored order, in the order of ``A``'s columns."""
        return torch.empty_like(stored).index_copy_(0, self.perm_t, stored)

    def off_norms(self, stored: bool = False) -> Tensor:
        """``[n]``: each column's distance to the span of the factorised ones (in stored
        order if ``stored``; zero for the factorised ones)."""
        p = self.size
        off = self.tt.new_zeros(self.n)
        off[p:] = _norm(self.tt[p : self.n, p:], dim=1)
        return off if stored else self.to_columns(off)

    def dual(self) -> Tensor:
        """``Aᵀr`` ``[n]`` in stored order, ``r`` the residual of :meth:`solve` (zero on the
        factorised columns)."""
        p = self.size
        tail = self.tt[p:, p:]
        w = self.tt.new_zeros(self.n)
        w[p:] = tail[:-1] @ tail[-1]
        return w

    def off_norm(self, j: int) -> float:
        """Column ``j``'s distance to the span of the factorised ones."""
        return float(_norm(self.tt[self.where[j], self.size :]))

    def residual_norm(self) -> float:
        """``‖A_cols z − b‖`` at the solution ``z`` of :meth:`solve`."""
        return float(_norm(self.tt[self.n, self.size :]))

    def _swap(self, p: int, q: int) -> None:
        """The stored places ``p`` and ``q`` exchange their columns."""
        row = self.tt[q].clone()
        self.tt[q] = self.tt[p]
        self.tt[p] = row
        jp, jq = self.perm[p], self.perm[q]
        self.perm[p], self.perm[q], self.where[jq], self.where[jp] = jq, jp, p, q
        self.perm_t[p], self.perm_t[q] = jq, jp

    def add(self, j: int) -> None:
        """Column ``j`` joins (last): one Householder reflection of rows ``p:`` of ``T``.
        The caller makes sure ``j`` is off the span (``off_norm(j) > 0``)."""
        p, q = self.size, self.where[j]
        if q != p:
            self._swap(p, q)
        tail = self.tt[p:, p:]  # rows p: of T, columns not factorised (theirs are zero)
        v = tail[0].clone()
        alpha = float(_norm(v))
        if float(v[0]) > 0.0:
            alpha = -alpha
        v[0] -= alpha  # v = x − αe₁ with α of the opposite sign of x₀: no cancellation
        vv = float(v @ v)
        if vv > 0.0:
            tail.addr_(tail @ v, v, alpha=-2.0 / vv)
        tail[0, 0] = alpha
        tail[0, 1:] = 0.0
        self.size = p + 1

    def drop(self, j: int) -> None:
        """Column ``j`` leaves: the columns behind it move one place forward, one row below
        the diagonal, and are rotated back onto it by blocks of ``BLOCK`` rows."""
        i, p = self.where[j], self.size
        self.tt[i:p] = self.tt[i:p].roll(-1, 0)
        self.perm_t[i:p] = self.perm_t[i:p].roll(-1, 0)
        self.perm[i:p] = [*self.perm[i + 1 : p], j]
        for q in range(i, p):
            self.where[self.perm[q]] = q
        self.size = p - 1
        for k in range(i, p - 1, BLOCK):
            h = min(BLOCK, p - 1 - k)
            block = self.tt[k:, k : k + h + 1]  # rows k … k + h of T, transposed
            q = torch.linalg.qr(block[:h].T, mode="complete").Q
            block.copy_(block @ q)  # under the diagonal: rounding, never read

    def solve(self) -> Tensor:
        """``z`` ``[p]`` (in the order of ``cols``) minimising ``‖A_cols z − b‖``."""
        p = self.size
        r_t = self.tt[:p, :p].contiguous()  # Rᵀ: R in column-major order
        z: Tensor = torch.linalg.solve_triangular(
            r_t.T, self.tt[self.n, :p, None], upper=True)[:, 0]
        return z
