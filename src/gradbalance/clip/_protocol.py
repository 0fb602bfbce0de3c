"""The protocol of a per-task clipper: what ``TaskGradBuffer.apply_(clip=...)`` calls."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["RowClipper", "scales_whole_rows"]


@runtime_checkable
class RowClipper(Protocol):
    """Clips the rows of the task-gradient matrix ``G`` ``[K, P]`` in place before the combine
    and returns their pre-clip norms ``[K]``.

    One that scales whole rows by 2-norm may also declare it (:func:`scales_whole_rows`);
    ``mode="gramian"`` then scales ``G Gᵀ`` and a sharded trunk each rank's columns.

    Example:
        >>> import torch
        >>> from gradbalance.clip import RowClipper, TaskClip
        >>> def halve(matrix: torch.Tensor) -> torch.Tensor:  # a clipper of one's own
        ...     norms = matrix.norm(dim=1)
        ...     matrix.mul_(0.5)
        ...     return norms
        >>> isinstance(halve, RowClipper), isinstance(TaskClip(max_norm=1.0), RowClipper)
        (True, True)
    """

    def __call__(self, matrix: Tensor) -> Tensor: ...


def scales_whole_rows(clip: object) -> bool:
    """Whether ``clip`` scales each whole row by a factor of its 2-norm: it declares both
    ``norm_type = 2.0`` and ``coefficients(norms) -> [K]`` (each row's factor)."""
    return callable(getattr(clip, "coefficients", None)) and (
        getattr(clip, "norm_type", None) == 2.0)
