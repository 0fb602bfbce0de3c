"""Shape conventions and the error a non-finite gradient raises.

Shapes used throughout the library:

* ``K``: number of tasks; ``P``: number of shared (trunk) parameters, flattened.
* task-gradient matrix ``G``: ``[K, P]``, row ``k`` is task ``k``'s gradient.
* Gramian ``G Gᵀ``: ``[K, K]``, kept in float64.
* weights: ``[K]``; combined gradient: ``[P]``.

The argument checks are in :mod:`gradbalance._checks`.
"""

from __future__ import annotations

__all__ = ["NonFiniteGradientError"]


class NonFiniteGradientError(ValueError):
    """A task gradient (or Gramian) holds inf or NaN; no state was changed."""
