"""The protocol of a per-task clipper: what ``TaskGradBuffer.apply_(clip=...)`` calls."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["RowClipper"]


@runtime_checkable
class RowClipper(Protocol):
    """Clips the rows of the task-gradient matrix ``G`` ``[K, P]`` in place before the combine
    and returns their pre-clip norms ``[K]``.

    A clipper that scales whole rows by 2-norm may also define ``norm_type = 2.0`` and
    ``coefficients(norms) -> [K]`` (the factor each row is multiplied by, given the pre-clip
    norms); ``mode="gramian"`` then applies it to ``G Gᵀ`` without the rows (``TaskClip`` and
    ``TaskAutoClip`` do).
    """

    def __call__(self, matrix: Tensor) -> Tensor: ...
