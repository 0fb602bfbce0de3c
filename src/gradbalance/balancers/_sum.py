"""Sum: the plain multitask step, ``g = Σₖ gₖ`` (equivalent to ``sum(losses).backward()``)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_square
from ._base import Balancer

__all__ = ["Sum", "sum_weights"]


def sum_weights(gramian: Tensor) -> Tensor:
    """All-ones weights ``[K]``.

    Example:
        >>> import torch
        >>> from gradbalance.functional import sum_weights
        >>> sum_weights(torch.eye(3, dtype=torch.float64))
        tensor([1., 1., 1.], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    return torch.ones(gramian.shape[0], dtype=gramian.dtype, device=gramian.device)


class Sum(Balancer):
    """``g = Σₖ gₖ``, the unbalanced baseline: ``wₖ = 1``.

    Cost in K: ``O(K)`` weights and the sum ``O(KP)``; no Gramian.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import Sum
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> Sum()(g)
        tensor([1., 2.], dtype=torch.float64)
    """

    name = "sum"
    from_gramian = True
    weight_degree = 0.0

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return sum_weights(gramian)
