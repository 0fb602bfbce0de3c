"""Constant: fixed user weights, ``g = Σₖ wₖ gₖ``."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .._checks import as_task_vector
from ._base import Balancer

__all__ = ["Constant"]


class Constant(Balancer):
    """``g = Σₖ wₖ gₖ`` with weights fixed at construction.

    Cost in K: ``O(K)`` weights and the sum ``O(KP)``; no Gramian.

    Args:
        weights: one finite number per task (``K`` is ``len(weights)``).

    Example:
        >>> import torch
        >>> from gradbalance.balancers import Constant
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> Constant([1.0, 3.0])(g)
        tensor([1., 6.], dtype=torch.float64)
    """

    name = "constant"
    from_gramian = True
    weight_degree = 0.0
    per_task_settings = ("_weights",)

    def __init__(self, weights: Sequence[float] | Tensor) -> None:
        w = as_task_vector("weights", weights)
        super().__init__(num_tasks=w.numel())
        self._weights = w

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return self._weights.to(device=gramian.device)

    def __repr__(self) -> str:
        return f"Constant(weights={self._weights.tolist()})"
