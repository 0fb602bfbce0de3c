"""``features`` mode: ``Z = [∂Lₖ/∂f]ₖ`` for the trunk's output ``f``, combined into ``z``, then
one backward of ``z`` through the trunk (docs/performance.md, "Modes").

Reference: Sener & Koltun, "Multi-Task Learning as Multi-Objective Optimization", NeurIPS
2018, §3.3 (MGDA-UB).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._amp import finite_step, unscaled_gramian
from .._graph import reached_around
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper
from ..distributed import all_gather_columns, all_reduce_grads_and_losses_
from ..stats import StepStats, build_stats
from ..taskgrads import ParamLayout, Passes, TaskRoots
from ._engine import (
    RowsEngine,
    StepInput,
    combine_or_skip,
    commit,
    heads_backward_,
    settle,
)
from ._layout import Columns, columns_of
from ._sharded import check_replicated_heads

__all__ = ["FeaturesMode"]


class FeaturesMode(RowsEngine):
    """Holds the feature gradients of one micro-batch until ``apply``; no row clipper."""

    mode = "features"
    shardable = True
    features: Tensor | None = None

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        super().__init__(layout, head_params, passes, modules)
        self.columns: Columns = columns_of(layout, head_params, passes)
        if self.columns.shard is not None:
            check_replicated_heads(head_params)

    def check_backward(self, features: Tensor | None, count: int, reused: bool) -> None:
        if reused:  # a step reusing cached weights takes any number of backward() calls
            return
        if count > 0:
            raise ValueError(
                "mode='features' takes one backward() per step (the trunk's backward of the "
                "balanced feature gradient needs every micro-batch's graph); call apply_() "
                "after each backward(), or use mode='matrix' or 'gramian' to accumulate "
                "micro-batches"
            )
        if not isinstance(features, Tensor) or not features.requires_grad:
            found = "None" if features is None else (
                type(features).__name__ if not isinstance(features, Tensor)
                else f"a tensor of shape {tuple(features.shape)} that does not require grad "
                     f"(detached, or computed under torch.no_grad())")
            raise ValueError(
                f"mode='features' needs features=<the trunk's output tensor> (requiring "
                f"grad), got {found}; e.g. feats = model.trunk(x); "
                f"buf.backward(losses, features=feats)"
            )
        self.columns.check_features(features)

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        if clip is not None:
            raise ValueError(
                f"clip needs the task-gradient rows of mode='matrix'; this buffer has "
                f"mode={self.mode!r}"
            )

    def backward(self, roots: TaskRoots, first: bool, features: Tensor | None) -> None:
        assert features is not None  # check_backward ran
        # a walk of the heads' graph, stopping at features: a path around it is refused
        met, index = reached_around(roots.scaled, features.grad_fn, self.layout.params)
        if not met:
            raise _unread(features)
        if index is not None:
            raise ValueError(
                f"mode='features' backpropagates the losses into the trunk through features= "
                f"only, but the losses reach shared parameter {index} (shape "
                f"{tuple(self.layout.params[index].shape)}) on a path that does not pass "
                f"through it (a skip connection around features, a trunk weight tied to or "
                f"read by a head, a "
                f"penalty on a trunk weight in a loss, or features= taken before the trunk's "
                f"last layers): its gradient would be lost; pass the trunk's last output as "
                f"features=, or use mode='matrix' or 'gramian'"
            )
        layout = ParamLayout([features])
        dtype = torch.promote_types(layout.dtype, torch.float32)  # autocast: fp16 features
        k = roots.num_tasks
        if self.matrix is None or self.matrix.shape != (k, layout.numel) or (
            self.matrix.dtype != dtype
        ):
            self.matrix = torch.empty(k, layout.numel, dtype=dtype, device=layout.device)
        heads = heads_backward_(roots, self.head_params)
        reached = [False]
        self.compute(roots, layout, self.matrix, accumulate=False, retain_graph=True,
                     reached=reached)
        if not reached[0]:
            raise _unread(features)
        heads.accumulate_()
        self.features = features

    def apply(self, balancer: Balancer, step: StepInput) -> StepStats:
        matrix, features, losses, scale = self.matrix, self.features, step.losses, step.scale
        assert matrix is not None and features is not None
        self.features = None
        local = slice(0, matrix.shape[1])
        if step.group is not None:
            rank = dist.get_rank(step.group)
            losses = all_reduce_grads_and_losses_(self.head_params, losses, step.group)
            matrix = all_gather_columns(matrix, step.group).div_(dist.get_world_size(step.group))
            local = slice(rank * features.numel(), (rank + 1) * features.numel())
        gram = unscaled_gramian(scale, matrix=matrix)
        finite = finite_step(gram, scale, self.head_params, step.group, losses)
        result = combine_or_skip(balancer, matrix, losses, gram, finite, scale)
        vector, weights = result.vector, result.weights
        grad = vector[local] if scale is None else vector[local] * scale.to(vector.dtype)
        update = self.columns.features_update(features, grad, step.group)
        finite = settle(update, step, finite)
        stats = build_stats(gram, losses, finite, matrix=matrix, update=vector,
                            weights=weights, scale=scale, num_backward=step.count,
                            mode=self.mode)
        commit(update, self.head_params, finite)
        return stats

    def clear(self) -> None:
        self.features = None


def _unread(features: Tensor) -> ValueError:
    return ValueError(
        f"no task loss depends on features (shape {tuple(features.shape)}), so the trunk "
        f"would get no gradient; pass the tensor the heads read, from the same forward as "
        f"the losses"
    )
