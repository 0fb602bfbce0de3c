"""``matrix`` mode: the ``[K, P]`` task gradients in one persistent buffer, then the combine.

Per micro-batch, ``G += [∂Lₖ/∂θ]ₖ`` (one ``autograd.grad`` per task, each starting at the
task's own loss) and the heads' ``.grad +=`` their plain gradient (one pass of ``Σₖ Lₖ`` over
the heads). Once per step: mean over data-parallel ranks, ``G /= s`` (the loss
scale), the Gramian in float64, the finiteness check from its diagonal, optional row
clipping, the combine, and ``.grad += s·g`` on the trunk.
"""

from __future__ import annotations

import torch

from ..balancers._base import Balancer
from ..distributed import all_ranks_true, all_reduce_step_
from ..gramian import compute_gramian
from ..stats import StepStats, build_stats
from ..taskgrads import TaskRoots
from ._common import (
    RowsMode,
    StepInput,
    add_flat_,
    combine_or_skip,
    heads_backward_,
    unscaled_gramian,
)

__all__ = ["MatrixMode"]


class MatrixMode(RowsMode):
    """Holds ``G`` ``[K, P]`` across micro-batches; combines it once per step."""

    def backward(self, roots: TaskRoots, first: bool) -> None:
        """``G += task gradients`` (``G =`` on the step's first micro-batch); heads ``+=``."""
        k = roots.num_tasks
        if self.matrix is None or self.matrix.shape[0] != k:
            self.matrix = torch.empty(
                k, self.layout.numel, dtype=self.layout.dtype, device=self.layout.device
            )
        heads_backward_(roots, self.head_params)
        self.compute(roots, self.layout, self.matrix, accumulate=not first)

    def apply(self, balancer: Balancer, step: StepInput) -> StepStats:
        matrix, losses, scale = self.matrix, step.losses, step.scale
        assert matrix is not None
        if step.group is not None:  # mean over the ranks, before unscaling and balancing
            losses = all_reduce_step_(matrix, losses, self.head_params, step.group)
        gram, finite_flag = unscaled_gramian(matrix, scale, self.head_params)
        if step.group is not None:  # every rank skips the same steps
            finite_flag = all_ranks_true(finite_flag, step.group)
        finite = bool(finite_flag)  # host sync: the balancer must not see inf/NaN
        pre_clip = None
        if finite and step.clip is not None:
            pre_clip = step.clip(matrix)
            gram = compute_gramian(matrix)
        result = combine_or_skip(balancer, matrix, losses, gram, finite, scale)
        add_flat_(self.layout, result.vector, scale)
        return build_stats(gram, losses, finite, matrix=matrix, update=result.vector,
                           weights=result.weights, scale=scale, pre_clip_norms=pre_clip,
                           num_backward=step.count)

    def clear(self) -> None:
        """Nothing to drop: ``G`` is overwritten by the next step's first backward."""
