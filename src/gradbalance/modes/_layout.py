"""Where a step's task-gradient columns lie, local or sharded, so that each mode is written once
(docs/distributed.md, "Sharded trunks (FSDP2)")."""

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
from ._engine import RowsEngine, WriteBack
from ._local import LocalColumns
from ._sharded import ShardedColumns

__all__ = ["Columns", "Held", "columns_of"]


Held = Any  # what a reused step holds between micro-batches, read by its Columns only


class Columns(Protocol):
    """A trunk's columns of the task gradients, local or sharded."""

    shard: Shard | None  # None: every column is here
    numel: int  # columns held here
    dtype: torch.dtype
    device: torch.device

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        """Raise (before anything moves) if ``balancer`` or ``clip`` cannot run here."""

    def task_passes(self, engine: RowsEngine, roots: TaskRoots, out: Tensor,
                    first: bool) -> None:
        """``out (+)=`` the task gradients of these columns; the heads' ``.grad +=``."""

    def reduce_(self, matrix: Tensor, losses: Tensor, heads: Sequence[Tensor],
                group: Any) -> Tensor:
        """Average over the ranks what each holds of the batch; the mean losses."""

    def clip_(self, clip: RowClipper, matrix: Tensor, gram: Tensor) -> Tensor:
        """Clip the rows (in place) as ``clip`` clips the full rows; their pre-clip norms."""

    def write_back(self, vector: Tensor, scale: Tensor | None,
                   reached: Sequence[bool] | None) -> WriteBack:
        """The update ``s·g`` of these columns, built in full, not written."""

    def stats(self, gram: Tensor, losses: Tensor, finite: bool, **fields: Any) -> StepStats:
        """The step's statistics, alike on every rank."""

    def features_update(self, features: Tensor, grad: Tensor, group: Any) -> WriteBack:
        """The trunk's update from one backward of ``⟨features, grad⟩`` (``features`` mode)."""

    def check_features(self, features: Tensor) -> None:
        """Raise if no trunk parameter lies on ``features``' graph (where it can be told)."""

    def reused_backward(self, weights: Tensor, roots: TaskRoots, heads: Sequence[Tensor],
                        held: Held | None) -> Held:
        """A reuse step's micro-batch: the trunk's ``Σₖ wₖ ∂(s·Lₖ)/∂θ`` added to ``held``."""

    def reused_update(self, held: Held | None, losses: Tensor, heads: Sequence[Tensor],
                      group: Any) -> tuple[WriteBack, Tensor]:
        """The reuse step's update, built in full, and the mean losses."""


def columns_of(layout: ParamLayout, head_params: Sequence[Tensor], passes: Passes) -> Columns:
    """The columns of ``layout``: sharded for ``DTensor`` parameters, else local."""
    if not is_sharded(layout.params):
        return LocalColumns(layout)
    return ShardedColumns(layout, head_params, passes)
