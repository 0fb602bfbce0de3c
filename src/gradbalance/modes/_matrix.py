"""``matrix`` mode: the ``[K, P]`` task gradients in one persistent buffer, then the combine."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._amp import finite_step, unscaled_gramian
from .._shard import full_gramian
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper
from ..stats import StepStats
from ..taskgrads import ParamLayout, Passes, TaskRoots
from ._engine import RowsEngine, StepInput, combine_or_skip, commit, reject_features, settle
from ._layout import Columns, columns_of

__all__ = ["MatrixMode"]


class MatrixMode(RowsEngine):
    """Holds ``G`` ``[K, P]`` (a rank's columns when sharded) across micro-batches."""

    mode = "matrix"
    shardable = True

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        super().__init__(layout, head_params, passes, modules)
        self.columns: Columns = columns_of(layout, head_params, passes)

    def check_backward(self, features: Tensor | None, count: int, reused: bool) -> None:
        reject_features(self.mode, features)

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        self.columns.check_apply(balancer, clip)

    def backward(self, roots: TaskRoots, first: bool, features: Tensor | None = None) -> None:
        """``G += task gradients`` (``G =`` on the step's first micro-batch); heads ``+=``."""
        k, columns = roots.num_tasks, self.columns
        if self.matrix is None or self.matrix.shape[0] != k:
            self.matrix = torch.empty(k, columns.numel, dtype=columns.dtype,
                                      device=columns.device)
        columns.task_passes(self, roots, self.matrix, first)

    def apply(self, balancer: Balancer, step: StepInput) -> StepStats:
        matrix, losses, scale, columns = self.matrix, step.losses, step.scale, self.columns
        assert matrix is not None
        if step.group is not None:  # mean over the ranks, before unscaling and balancing
            losses = columns.reduce_(matrix, losses, self.head_params, step.group)
        gram = unscaled_gramian(scale, matrix=matrix, shard=columns.shard)
        finite = finite_step(gram, scale, self.head_params, step.group, losses)
        pre_clip = None
        if finite and step.clip is not None:
            pre_clip = columns.clip_(step.clip, matrix, gram)
            gram = full_gramian(matrix, columns.shard)
        result = combine_or_skip(balancer, matrix, losses, gram, finite, scale, columns.shard)
        vector, weights = result.vector, result.weights
        update = columns.write_back(vector, scale, self.reached if step.group is None else None)
        finite = settle(update, step, finite)
        stats = columns.stats(gram, losses, finite, matrix=matrix, update=vector,
                              weights=weights, scale=scale, pre_clip_norms=pre_clip,
                              num_backward=step.count, mode=self.mode)
        commit(update, self.head_params, finite)
        return stats

    def clear(self) -> None:
        """Nothing to drop: ``G`` is overwritten by the next step's first backward."""
