"""``matrix`` mode: the ``[K, P]`` task gradients in one persistent buffer, then the combine.

Per micro-batch, ``G += [∂Lₖ/∂θ]ₖ`` (one ``autograd.grad`` per task, each starting at the
task's own loss) and the heads' ``.grad +=`` their plain gradient (one pass of ``Σₖ Lₖ`` over
the heads). Once per step: mean over data-parallel ranks, ``G /= s`` (the loss
scale), the Gramian in float64, the finiteness check from its diagonal, optional row
clipping, the combine, and ``.grad += s·g`` on the trunk, written last. A parameter no task
reached in any micro-batch keeps its ``.grad`` (None stays None), as after
``sum(losses).backward()``; under data parallelism every parameter is written, since another
rank may have reached it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._amp import finite_step, unscaled_gramian
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper
from ..distributed import all_reduce_step_
from ..gramian import compute_gramian
from ..stats import StepStats, build_stats
from ..taskgrads import TaskRoots
from ._engine import (
    RowsEngine,
    StepInput,
    WriteBack,
    combine_or_skip,
    commit,
    heads_backward_,
    reject_features,
    settle,
)

__all__ = ["MatrixMode"]


class MatrixMode(RowsEngine):
    """Holds ``G`` ``[K, P]`` across micro-batches; combines it once per step. Every balancer
    and every row clipper works here."""

    mode = "matrix"

    def check_backward(self, features: Tensor | None, count: int, reused: bool) -> None:
        reject_features(self.mode, features)

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        """Everything is supported."""

    def backward(self, roots: TaskRoots, first: bool, features: Tensor | None = None) -> None:
        """``G += task gradients`` (``G =`` on the step's first micro-batch); heads ``+=``."""
        k = roots.num_tasks
        if self.matrix is None or self.matrix.shape[0] != k:
            self.matrix = torch.empty(
                k, self.layout.numel, dtype=self.layout.dtype, device=self.layout.device
            )
        if first:
            self.reached = [False] * len(self.layout.params)
        heads_backward_(roots, self.head_params)
        self.compute(roots, self.layout, self.matrix, accumulate=not first,
                     reached=self.reached)

    def apply(self, balancer: Balancer, step: StepInput) -> StepStats:
        matrix, losses, scale = self.matrix, step.losses, step.scale
        assert matrix is not None
        if step.group is not None:  # mean over the ranks, before unscaling and balancing
            losses = all_reduce_step_(matrix, losses, self.head_params, step.group)
        gram = unscaled_gramian(scale, matrix=matrix)
        finite = finite_step(gram, scale, self.head_params, step.group)
        pre_clip = None
        if finite and step.clip is not None:
            pre_clip = step.clip(matrix)
            gram = compute_gramian(matrix)
        result = combine_or_skip(balancer, matrix, losses, gram, finite, scale)
        vector, weights = result.vector, result.weights
        reached = self.reached if step.group is None else None
        update = WriteBack.from_flat(self.layout, vector, scale, reached)
        finite = settle(update, step, finite)
        stats = build_stats(gram, losses, finite, matrix=matrix, update=vector,
                            weights=weights, scale=scale, pre_clip_norms=pre_clip,
                            num_backward=step.count)
        commit(update, self.head_params, finite)
        return stats

    def clear(self) -> None:
        """Nothing to drop: ``G`` is overwritten by the next step's first backward."""
