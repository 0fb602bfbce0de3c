"""Where a step's task-gradient columns lie, so that each mode is written once.

A trunk's ``[K, P]`` task gradients are either all on this process
(:class:`~gradbalance.modes._local.LocalColumns`; under data parallelism each rank holds its
own batch's, averaged over the ranks) or split over the ranks of a trunk sharded with
``fully_shard`` (:class:`~gradbalance.modes._sharded.ShardedColumns`; each rank holds its
columns of the full batch's). :class:`Columns` is what a mode asks of either: the K task
passes, the reduction over the ranks, the clipping, the write-back, the statistics and
``update_every``'s reused steps. The Gramian is the full one on both
(``_amp.unscaled_gramian`` with :attr:`Columns.shard`), and so is the combine
(``Balancer.combine(..., shard=)``): ``docs/distributed.md``, "Sharded trunks (FSDP2)".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from .._shard import Shard
from .._sharding import is_sharded
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper
from ..stats import StepStats
from ..taskgrads import ParamLayout, Passes, TaskRoots
from ._engine import RowsEngine, Update
from ._local import LocalColumns
from ._sharded import ShardedColumns

__all__ = ["Columns", "Held", "columns_of"]


#: What a reused step holds between its micro-batches: per-parameter gradients (local) or a
#: rank's flat columns (sharded); only the :class:`Columns` that made it reads it.
Held = Any


class Columns(Protocol):
    """A trunk's columns of the task gradients, local or sharded (this module's docstring)."""

    #: ``None``: every column is here; else this rank's columns and the sum over the ranks.
    shard: Shard | None
    #: Columns held here, their dtype and device (a ``[K, numel]`` buffer holds them).
    numel: int
    dtype: torch.dtype
    device: torch.device

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        """Raise (before anything moves) if ``balancer`` or ``clip`` cannot run here."""
        ...

    def task_passes(self, engine: RowsEngine, roots: TaskRoots, out: Tensor,
                    first: bool) -> None:
        """``out (+)=`` the task gradients of these columns; the heads' ``.grad +=`` their
        plain gradient."""
        ...

    def reduce_(self, matrix: Tensor, losses: Tensor, heads: Sequence[Tensor],
                group: Any) -> Tensor:
        """Average over the ranks what each holds of the batch; the mean losses."""
        ...

    def clip_(self, clip: RowClipper, matrix: Tensor, gram: Tensor) -> Tensor:
        """Clip the rows (in place) as ``clip`` clips the full rows; their pre-clip norms."""
        ...

    def write_back(self, vector: Tensor, scale: Tensor | None,
                   reached: Sequence[bool] | None) -> Update:
        """The update ``s·g`` of these columns, built in full, not written."""
        ...

    def stats(self, gram: Tensor, losses: Tensor, finite: bool, **fields: Any) -> StepStats:
        """The step's statistics, alike on every rank."""
        ...

    def features_update(self, features: Tensor, grad: Tensor, group: Any) -> Update:
        """The trunk's update from one backward of ``⟨features, grad⟩`` (``features`` mode;
        ``grad``: this rank's columns of the balanced gradient, flat). Under data
        parallelism or a sharded trunk the ranks' parts are averaged (all-reduced, or
        reduce-scattered by FSDP2), so each is multiplied by the world size ``W`` first."""
        ...

    def check_features(self, features: Tensor) -> None:
        """Raise if no trunk parameter lies on ``features``' graph (where it can be told
        before the backward)."""
        ...

    def reused_backward(self, weights: Tensor, roots: TaskRoots, heads: Sequence[Tensor],
                        held: Held | None) -> Held:
        """``update_every``'s step reusing ``weights``: the heads' ``.grad +=`` their plain
        gradient, the trunk's ``Σₖ wₖ ∂(s·Lₖ)/∂θ`` added to ``held`` (None: the step's
        first micro-batch), which is returned."""
        ...

    def reused_update(self, held: Held | None, losses: Tensor, heads: Sequence[Tensor],
                      group: Any) -> tuple[Update, Tensor]:
        """The held update of a reused step, built in full, and the losses, both averaged
        over the ranks (with the heads' ``.grad``)."""
        ...


def columns_of(layout: ParamLayout, head_params: Sequence[Tensor], passes: Passes) -> Columns:
    """The columns of ``layout``: sharded when its parameters are ``DTensor``s (a trunk
    under ``fully_shard``), else all local."""
    if not is_sharded(layout.params):
        return LocalColumns(layout)
    return ShardedColumns(layout, head_params, passes)
