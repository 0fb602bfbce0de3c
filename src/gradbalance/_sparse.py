"""Sparse gradients (``nn.Embedding(sparse=True)``) in their dense form: a row of ``G`` and the
update are dense in general (docs/loop.md, "Inputs plain PyTorch takes")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["dense", "dense_all"]


def dense(grad: Tensor) -> Tensor:
    """``grad`` itself when strided, else its dense form (a sparse gradient, coalesced)."""
    return grad if grad.layout == torch.strided else grad.to_dense()


def dense_all(grads: Sequence[Tensor | None]) -> list[Tensor | None]:
    """:func:`dense` of each gradient, None kept."""
    return [None if g is None else dense(g) for g in grads]
