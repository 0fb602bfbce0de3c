"""Shape conventions and the error a non-finite gradient raises.

Shapes used throughout the library:

* ``K``: number of tasks; ``P``: number of shared (trunk) parameters, flattened.
* task-gradient matrix ``G``: ``[K, P]``, row ``k`` is task ``k``'s gradient.
* Gramian ``G Gᵀ``: ``[K, K]``, kept in float64.
* weights: ``[K]``; combined gradient: ``[P]``.

The argument checks are in :mod:`gradbalance._checks`. The three functions below take the
value first and the argument's name after it, the order :mod:`gradbalance_lab.microbatch`
calls them in; they only forward to :mod:`gradbalance._checks`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import Tensor

from . import _checks

__all__ = [
    "NonFiniteGradientError",
    "as_loss_vector",
    "as_parameter_list",
    "check_matrix",
]


class NonFiniteGradientError(ValueError):
    """A task gradient (or Gramian) holds inf or NaN; no state was changed."""


def as_loss_vector(
    losses: Tensor | Sequence[Tensor], num_tasks: int | None = None, argname: str = "losses"
) -> Tensor:
    """:func:`gradbalance._checks.as_loss_vector` with the value first."""
    return _checks.as_loss_vector(argname, losses, num_tasks)


def as_parameter_list(
    params: Iterable[Tensor] | Tensor | None, argname: str, allow_empty: bool = False
) -> list[Tensor]:
    """:func:`gradbalance._checks.as_parameter_list` with the value first."""
    return _checks.as_parameter_list(argname, params, allow_empty)


def check_matrix(matrix: Tensor, num_tasks: int | None = None, argname: str = "matrix") -> None:
    """:func:`gradbalance._checks.check_matrix` with the value first."""
    _checks.check_matrix(argname, matrix, num_tasks)
