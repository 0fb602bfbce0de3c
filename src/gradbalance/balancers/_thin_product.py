"""Products ``A B`` whose right factor has a few columns, in the layout multiplied fast.

Not a balancer module (no ``__all__``). A row-major ``B`` ``[K, m]`` with ``2 ≤ m ≤ 15``
columns (the outlying eigenvectors of :mod:`._precond` and :mod:`._projected`, nine for a
classifier's per-sample rows) takes the BLAS's small-``n`` kernel: one thread, float32,
``[1024, 1024] × [1024, 9]`` took 1.6 ms, against 0.45 ms for the same product as ``(BᵀAᵀ)ᵀ``
and 0.45 ms at ``m = 16`` (``[256, 256] × [256, 9]``: 100 against 28 µs; float64 alike). The
transposed product reads the same entries and makes the same sums, in another order: its
rounding is a product's, not bit for bit the other layout's.

Example:
    >>> import torch
    >>> a, b = torch.randn(6, 5, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    >>> torch.allclose(thin_product(a, b), a @ b)
    True
"""

from __future__ import annotations

from torch import Tensor

#: The column counts taken transposed: from 2 (one column is a matrix-vector product) to
#: 15 (from 16 on the row-major product is as fast or faster).
THIN_COLUMNS = range(2, 16)


def thin_product(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (``[B, K] × [K, m]``), as ``(bᵀ aᵀ)ᵀ`` (a transposed view) where ``b`` has
    :data:`THIN_COLUMNS` columns, else as it is."""
    if a.dim() == 2 and b.dim() == 2 and b.shape[1] in THIN_COLUMNS:
        return (b.T @ a.T).T
    return a @ b
