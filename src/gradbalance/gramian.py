"""The Gramian ``G Gᵀ`` of a task-gradient matrix, accumulated in float64."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["compute_gramian", "cosine_matrix", "is_finite_gramian", "linear_gramian"]

_COLUMN_BLOCK = 1 << 20


def compute_gramian(matrix: Tensor, block: int = _COLUMN_BLOCK) -> Tensor:
    """Return ``G Gᵀ`` ``[K, K]`` in float64.

    Each column block is multiplied in the matrix's own dtype (fast BLAS) and the block
    products are summed in float64, so rounding does not grow with ``P``.
    """
    k, p = matrix.shape
    gram = torch.zeros(k, k, dtype=torch.float64, device=matrix.device)
    if matrix.dtype == torch.float64 or p <= block:
        part = matrix if matrix.dtype in (torch.float32, torch.float64) else matrix.float()
        return gram.add_(part @ part.T)
    for start in range(0, p, block):
        part = matrix[:, start : start + block]
        if part.dtype not in (torch.float32, torch.float64):
            part = part.float()
        gram.add_(part @ part.T)
    return gram


def is_finite_gramian(gram: Tensor) -> Tensor:
    """True (0-d bool tensor) when every task gradient is finite.

    A non-finite entry in row ``k`` of ``G`` makes ``gram[k, k]`` inf or NaN, so the diagonal
    is enough: an O(K) check instead of O(K·P).
    """
    return torch.isfinite(torch.diagonal(gram)).all()


def cosine_matrix(gram: Tensor, eps: float = 1e-30) -> Tensor:
    """Pairwise cosine similarities ``[K, K]`` from the Gramian (0 where a norm is 0)."""
    norms = torch.diagonal(gram).clamp_min(0).sqrt()
    denom = torch.outer(norms, norms)
    return torch.where(denom > eps, gram / denom.clamp_min(eps), torch.zeros_like(gram))


def linear_gramian(x: Tensor, d: Tensor, weight: bool, bias: bool) -> Tensor:
    """``G_b G_bᵀ`` ``[K, K]`` (float64) of an ``nn.Linear`` ``y = x Wᵀ + b`` from its input
    ``x`` ``[N, i]`` and the output gradients ``d`` ``[K, N, o]`` (``d[k] = ∂Lₖ/∂y``).

    ``weight``/``bias``: whether each is among the shared parameters. The weight block takes
    the cheaper of two exact routes: the rows ``G_b[k] = d[k]ᵀ x`` (``2K·N·o·i`` flops, a
    ``[K, o·i]`` scratch), or the activations, ``⟨dᵢᵀx, dⱼᵀx⟩ = Σ_{n,m} (dᵢ dⱼᵀ)_{nm}
    (x xᵀ)_{nm}`` (``N²·i + K²N²·o`` flops, nothing weight-sized): the ghost trick of
    per-sample clipping, applied across tasks.
    """
    k, n, o = d.shape
    i = x.shape[1]
    gram = torch.zeros(k, k, dtype=torch.float64, device=d.device)
    if bias:
        s = d.sum(dim=1)
        gram += (s @ s.T).double()
    if weight:
        if n * n * (i + k * k * o) < 2 * k * n * o * i + k * k * o * i:
            a = x @ x.T  # [N, N]
            flat = d.reshape(k * n, o)
            m = (flat @ flat.T).view(k, n, k, n).permute(0, 2, 1, 3).reshape(k * k, n * n)
            gram += (m @ a.reshape(n * n)).view(k, k).double()
        else:
            rows = torch.matmul(d.transpose(1, 2), x).reshape(k, o * i)  # [K, o·i]
            gram += compute_gramian(rows)
    return gram
