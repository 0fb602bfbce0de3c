"""Where a step's task-gradient columns lie, so that each mode is written once.

A trunk's ``[K, P]`` task gradients are either all on this process (:class:`LocalColumns`;
under data parallelism each rank holds its own batch's, averaged over the ranks) or split
over the ranks of a trunk sharded with ``fully_shard``
(:class:`~gradbalance.modes._sharded.ShardedColumns`; each rank holds its columns of the
full batch's). :class:`Columns` is what a mode asks of either: the K task passes, the
reduction over the ranks, the clipping, the write-back and the statistics. The Gramian is
the full one on both (``_amp.unscaled_gramian`` with :attr:`Columns.shard`), and so is the
combine (``Balancer.combine(..., shard=)``): ``docs/distributed.md``, "Sharded trunks".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from .._sharding import is_sharded
from ..balancers._base import Balancer
from ..balancers._shard import Shard
from ..clip._protocol import RowClipper
from ..distributed import all_reduce_mean_, all_reduce_step_
from ..stats import StepStats, build_stats
from ..taskgrads import ParamLayout, Passes, TaskRoots
from ._engine import RowsEngine, Update, WriteBack, heads_backward_, owned_grads, reaches
from ._sharded import ShardedColumns

__all__ = ["Columns", "LocalColumns", "columns_of"]


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


class LocalColumns:
    """Every column of a trunk of plain parameters on this process."""

    shard: Shard | None = None

    def __init__(self, layout: ParamLayout) -> None:
        self.layout = layout
        self.numel, self.dtype, self.device = layout.numel, layout.dtype, layout.device

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        """Every balancer and every row clipper runs on whole rows."""

    def task_passes(self, engine: RowsEngine, roots: TaskRoots, out: Tensor,
                    first: bool) -> None:
        if first:
            engine.reached = [False] * len(self.layout.params)
        heads_backward_(roots, engine.head_params)
        engine.compute(roots, self.layout, out, accumulate=not first, reached=engine.reached)

    def reduce_(self, matrix: Tensor, losses: Tensor, heads: Sequence[Tensor],
                group: Any) -> Tensor:
        return all_reduce_step_(matrix, losses, heads, group)

    def clip_(self, clip: RowClipper, matrix: Tensor, gram: Tensor) -> Tensor:
        return clip(matrix)

    def write_back(self, vector: Tensor, scale: Tensor | None,
                   reached: Sequence[bool] | None) -> Update:
        return WriteBack.from_flat(self.layout, vector, scale, reached)

    def stats(self, gram: Tensor, losses: Tensor, finite: bool, **fields: Any) -> StepStats:
        """:func:`~gradbalance.stats.build_stats` of the whole rows."""
        return build_stats(gram, losses, finite, **fields)

    def features_update(self, features: Tensor, grad: Tensor, group: Any) -> Update:
        """One ``autograd.grad``; under data parallelism the ranks' parts summed (the mean
        of ``W·`` each part)."""
        params = self.layout.params
        grad = grad.view_as(features).to(features.dtype)
        if group is not None:
            grad = grad * dist.get_world_size(group)
        parts = list(torch.autograd.grad(features, params, grad, allow_unused=True))
        if group is not None:
            parts = [torch.zeros_like(p) if g is None else g for p, g in zip(params, parts)]
            all_reduce_mean_(parts, group)
        return WriteBack(params, parts, owned=owned_grads(parts))

    def check_features(self, features: Tensor) -> None:
        if not reaches(features, self.layout.params):
            raise ValueError(
                f"features (shape {tuple(features.shape)}) is not computed from "
                f"shared_params: no shared parameter lies on its graph (the input, another "
                f"module's output, a detached copy?), so the trunk would get no gradient; "
                f"pass the trunk's output, e.g. feats = model.trunk(x); "
                f"buf.backward(losses, features=feats)"
            )


def columns_of(layout: ParamLayout, head_params: Sequence[Tensor], passes: Passes) -> Columns:
    """The columns of ``layout``: sharded when its parameters are ``DTensor``s (a trunk
    under ``fully_shard``), else all local."""
    if not is_sharded(layout.params):
        return LocalColumns(layout)
    return ShardedColumns(layout, head_params, passes)
