"""Cholesky factorisation of large matrices in blocks of matrix products.

Not a balancer module (no ``__all__``). On one thread, LAPACK's ``potrf`` as ``torch``
calls it runs a ``1,024 × 1,024`` float64 matrix at about a sixth of the speed of a matrix
product of the same size (20 ms against 7 ms for the blocked form below, on a machine
where the product takes 20 ms), while it is as fast as anything from 256 down. The
left-looking blocked algorithm (Golub & Van Loan, *Matrix Computations*, 4th ed., §4.2.9)
updates one column block of ``BLOCK`` columns from the factor's columns left of it with
one product, factorises its diagonal block with ``potrf`` and solves the panel below with
one triangular solve: the same arithmetic in another order, rounding of the same size
(``‖LLᵀ − A‖ ≤ c·n·u·‖A‖``, Higham, *Accuracy and Stability*, Thm. 10.3). The gain is the
processor's: on an AMD EPYC (AVX-512, a float64 product of order 1,024 in 48 ms) ``potrf``
was as fast or faster at every order from 512 to 1,280 (median of 9, float32 / float64 in
ms, ``potrf`` against blocked: 512 1.4 / 3.5 against 2.3 / 3.0; 640 2.0 / 5.3 against
4.2 / 5.8; 896 5.0 / 9.9 against 11.2 / 11.6; 1,024 11.5 / 19.3 against 11.1 / 20.2).

Example:
    >>> import torch
    >>> from gradbalance.balancers._cholesky import cholesky_ex
    >>> a = torch.randn(600, 600, dtype=torch.float64)
    >>> a = a @ a.T + 600 * torch.eye(600, dtype=torch.float64)
    >>> low, info = cholesky_ex(a)
    >>> int(info), bool(torch.allclose(low @ low.T, a))
    (0, True)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch
from torch import Tensor

#: The order from which a single matrix is factorised in blocks (``potrf`` is as fast
#: below it: 0.34 ms against 0.39 ms at 256, 2.7 ms against 1.5 ms at 512, one thread).
BLOCKED_MIN_SIZE = 512
#: Rows per diagonal block.
BLOCK = 128
#: Principal blocks whose factors :class:`BlockFactors` keeps (the most recently used).
KEPT_BLOCKS = 4
_potrf = torch.linalg.cholesky_ex  # one global lookup on the small path (the step's K)
#: From this order on, :func:`principal_block` takes the columns within the gathered rows by
#: ``torch.gather`` (one thread: 0.50 against 1.56 ms for a block of 600 of 1,024, 0.14
#: against 0.17 ms for 256 blocks of 64 of 256); below, by ``index_select`` (3.3 against 4.8
#: µs for 3 of 4).
GATHER_MIN_SIZE = 64


def principal_block(q: Tensor, at: Tensor, out: Tensor | None = None) -> Tensor:
    """``Q[at][:, at]`` for the indices ``at`` ``[m]`` (into ``out`` where given): the rows
    gathered, then the columns within them."""
    rows = q.index_select(0, at)
    m = at.shape[0]
    if m < GATHER_MIN_SIZE:
        return torch.index_select(rows, 1, at, out=out)
    return torch.gather(rows, 1, at[None, :].expand(m, m), out=out)


class Factor(NamedTuple):
    """The lower factor and ``info``, as :func:`torch.linalg.cholesky_ex` names them."""

    L: Tensor
    info: Tensor


def cholesky_ex(a: Tensor) -> Factor:
    """``(L, info)`` as :func:`torch.linalg.cholesky_ex` (lower ``L``, ``info`` 0 or the
    order of the first leading minor that is not positive definite), blocked for a single
    matrix of order ``BLOCKED_MIN_SIZE`` or more; ``torch``'s own call otherwise. ``a`` is
    read, not written; only its lower triangle is read."""
    n = a.shape[-1]
    if n < BLOCKED_MIN_SIZE or a.ndim != 2:
        return _potrf(a)  # type: ignore[no-any-return]  # torch's own: the same two fields
    low = a.tril()
    for start in range(0, n, BLOCK):
        end = min(start + BLOCK, n)
        done = low[start:, :start]  # the factor's columns left of the block
        if start:
            low[start:, start:end] -= done @ done[: end - start].T
        diag, info = torch.linalg.cholesky_ex(low[start:end, start:end])
        if int(info) != 0:
            return Factor(low, torch.tensor(start + int(info), dtype=torch.int32))
        low[start:end, start:end] = diag
        if end < n:
            low[end:, start:end] = torch.linalg.solve_triangular(
                diag, low[end:, start:end].T, upper=False).T
    return Factor(low.tril_(), torch.tensor(0, dtype=torch.int32))


def cholesky_solve(rhs: Tensor, low: Tensor) -> Tensor:
    """``A⁻¹ rhs`` from ``A``'s lower Cholesky factor ``low`` (``[..., n, n]``, ``rhs``
    ``[..., n, k]``), as :func:`torch.cholesky_solve` (the same two triangular solves, rounding
    of the same size), by :func:`torch.linalg.solve_triangular` twice: on one thread
    ``torch.cholesky_solve`` took 5–10× as long (``n = 1,024``, one right-hand side: 1.7
    against 0.3 ms; 256 problems of ``n = 128``: 17 against 2 ms)."""
    half = torch.linalg.solve_triangular(low, rhs, upper=False)
    out: Tensor = torch.linalg.solve_triangular(low.mT, half, upper=True)
    return out


class BlockFactors:
    """The Cholesky factors of the principal blocks ``Q_FF`` of one matrix ``Q``, by index set
    ``F`` (:func:`cholesky_ex`), the ``KEPT_BLOCKS`` most recently used kept.

    CAGrad's root search factorises one support three times in a row: in its QP's last
    pivoting iteration, for the support's root and in the next QP's first iteration (at
    ``K = 1,024``, 80 of its 145 ms of factorisations were such repeats). ``Q`` is read, not
    written; a factor is shared with its callers, who must not write it.

    Example:
        >>> import torch
        >>> q = torch.tensor([[4.0, 2.0, 0.0], [2.0, 5.0, 1.0], [0.0, 1.0, 3.0]],
        ...                  dtype=torch.float64)
        >>> blocks = BlockFactors(q)
        >>> low = blocks.factor([0, 2]).L  # of [[4, 0], [0, 3]]
        >>> low.diagonal() ** 2, blocks.factor([0, 2]).L is low
        (tensor([4.0000, 3.0000], dtype=torch.float64), True)
    """

    def __init__(self, q: Tensor, kept: int = KEPT_BLOCKS) -> None:
        self.q = q
        self.kept = kept
        self._factors: OrderedDict[tuple[int, ...], Factor] = OrderedDict()

    def factor(self, idx: list[int]) -> Factor:
        """The factor of ``Q_FF`` for the increasing indices ``idx`` (computed once while
        kept; ``info`` non-zero where ``Q_FF`` is not positive definite)."""
        key = tuple(idx)
        got = self._factors.get(key)
        if got is not None:
            self._factors.move_to_end(key)
            return got
        if len(idx) == self.q.shape[0]:
            block = self.q
        else:
            sel = torch.tensor(idx, device=self.q.device)
            block = principal_block(self.q, sel)
        got = cholesky_ex(block)
        self._factors[key] = got
        if len(self._factors) > self.kept:
            self._factors.popitem(last=False)
        return got
