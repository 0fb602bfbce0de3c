"""Per-sample gradient forms of one parameter and the Gramian blocks between them.

A layer's site holds sample i's gradient as an outer form ``Aᵢᵀ Bᵢ`` (rows ``[n, S, m]``,
``[n, S, k]``) or materialised ``[n, numel]``. :func:`contracted` keeps the cheaper of the two
for the Gramian, as soon as the layer's output gradient is known (the rows of the other form
are then dropped); :func:`block` gives ``⟨gᵢ, gⱼ⟩`` between two forms, ``[nₐ, n_b]`` float64:
``Σₛₜ (Aᵢₛ·Aⱼₜ)(Bᵢₛ·Bⱼₜ)`` for two outer forms (the ghost-norm identity), ``Gₐ G_bᵀ``
otherwise. Products run in the forms' dtype (float32 inputs stay float32); the sums over
positions and the ``[n, n]`` products accumulate in float64 (docs/per_sample.md, "Layers").
"""

from __future__ import annotations

import torch
from torch import Tensor

from .clip._per_sample_tied import materialised

__all__ = ["Form", "block", "contracted"]

Form = tuple[Tensor, Tensor] | Tensor


def _dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def contracted(form: Form) -> Form:
    """``form`` as kept for the Gramian: an outer form materialised ``[n, numel]`` (its
    dtype) where ``n·S·m·k + n²·m·k`` (per-sample gradients, then their products) costs
    less than ``(n·S)²·(m + k)`` (the Gram form); else unchanged."""
    if isinstance(form, Tensor):
        return form
    a, b = form
    n, s, m = a.shape
    k = b.shape[2]
    rows = n * s
    if rows * rows * (m + k) <= rows * m * k + n * n * m * k:
        return form
    return materialised([form], _dtype(a, b))


def block(left: Form, right: Form) -> Tensor:
    """``[nₗ, nᵣ]`` float64: the inner products of ``left``'s per-sample gradients with
    ``right``'s (forms of the same parameter)."""
    if isinstance(left, Tensor) or isinstance(right, Tensor):
        dense = [f if isinstance(f, Tensor) else materialised([f], _dtype(*f))
                 for f in (left, right)]
        return dense[0].double() @ dense[1].double().T
    dtype = _dtype(*left, *right)
    (a, b), (c, e) = left, right
    n, s = a.shape[:2]
    n2, s2 = c.shape[:2]
    first = a.reshape(n * s, -1).to(dtype) @ c.reshape(n2 * s2, -1).to(dtype).T
    second = b.reshape(n * s, -1).to(dtype) @ e.reshape(n2 * s2, -1).to(dtype).T
    return (first * second).reshape(n, s, n2, s2).sum((1, 3), dtype=torch.float64)
