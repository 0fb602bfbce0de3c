"""Sparse gradients as dense tensors: the trunk of a balanced step may hold an
``nn.Embedding(sparse=True)`` (or ``nn.EmbeddingBag(sparse=True)``).

Autograd gives such a weight a sparse COO gradient, which has no ``reshape`` and no flat view.
A task's row of ``G`` and the balanced update are dense in general (a combination of the
tasks' rows touches the union of their indices), so the step takes the dense form, with the
same values: every mode then writes the trunk's ``.grad`` as a dense tensor, equal to the
``.grad`` of the same model with ``sparse=False`` (docs/loop.md, "Sparse embeddings").
"""

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
