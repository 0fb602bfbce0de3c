"""The protocol of a per-task clipper: what ``TaskGradBuffer.apply_(clip=...)`` calls."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["RowClipper", "scales_whole_rows"]


@runtime_checkable
class RowClipper(Protocol):
    """Clips the rows of the task-gradient matrix ``G`` ``[K, P]`` in place before the combine
    and returns their pre-clip norms ``[K]``.

    A clipper that scales whole rows by 2-norm may also define ``norm_type = 2.0`` and
    ``coefficients(norms) -> [K]`` (the factor each row is multiplied by, given the pre-clip
    norms); ``mode="gramian"`` then applies it to ``G Gᵀ`` without the rows, and a sharded
    trunk to each rank's columns (``TaskClip`` and ``TaskAutoClip`` do;
    :func:`scales_whole_rows`).
    """

    def __call__(self, matrix: Tensor) -> Tensor: ...


def scales_whole_rows(clip: object) -> bool:
    """Whether ``clip`` scales each whole row by a factor of its 2-norm: it declares
    ``norm_type = 2.0`` and a callable ``coefficients(norms) -> [K]`` (both required: a
    clipper that does not say which norm it clips is not assumed to clip the 2-norm)."""
    return callable(getattr(clip, "coefficients", None)) and (
        getattr(clip, "norm_type", None) == 2.0)
