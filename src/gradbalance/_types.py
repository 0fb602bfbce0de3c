"""The error a non-finite gradient raises, and the shapes used throughout the library.

``K`` tasks, ``P`` shared (trunk) parameter values; the task-gradient matrix ``G`` ``[K, P]``
(row ``k``: task ``k``'s gradient), its Gramian ``G Gᵀ`` ``[K, K]`` (float64), the weights
``[K]`` and the combined gradient ``[P]``.
"""

from __future__ import annotations

__all__ = ["NonFiniteGradientError"]


class NonFiniteGradientError(ValueError):
    """A task gradient (or Gramian) holds inf or NaN; no state was changed."""
