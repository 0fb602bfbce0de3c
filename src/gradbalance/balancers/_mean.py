"""Mean: equal weighting, ``g = (1/K) Σₖ gₖ`` (LibMTL's ``EW`` up to its factor K)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import check_square
from ._base import Balancer

__all__ = ["Mean", "mean_weights"]


def mean_weights(gramian: Tensor) -> Tensor:
    """Weights ``1/K`` ``[K]``.

    Example:
        >>> import torch
        >>> from gradbalance.functional import mean_weights
        >>> mean_weights(torch.eye(4, dtype=torch.float64))
        tensor([0.2500, 0.2500, 0.2500, 0.2500], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    k = gramian.shape[0]
    return torch.full((k,), 1.0 / k, dtype=gramian.dtype, device=gramian.device)


class Mean(Balancer):
    """``g = (1/K) Σₖ gₖ``: ``wₖ = 1/K``.

    Cost in K: ``O(K)`` weights and the sum ``O(KP)``; no Gramian.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import Mean
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> Mean()(g)
        tensor([0.5000, 1.0000], dtype=torch.float64)
    """

    name = "mean"
    from_gramian = True
    weight_degree = 0.0

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return mean_weights(gramian)
