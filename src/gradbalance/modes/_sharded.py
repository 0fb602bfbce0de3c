"""``matrix`` mode on a trunk sharded with FSDP2: each rank keeps its own columns ``[K, P/W]``.

Per micro-batch, K ordinary backward passes (one per task, from its own loss) let FSDP2
reduce-scatter each task's gradient; this rank's shard of it is added into row ``k`` of the
local buffer (:func:`~gradbalance.modes._sharded_passes.sharded_passes`). Once per step:

1. the losses and the heads' plain ``.grad`` (unless FSDP2 already averaged them, when the
   heads are sharded too) are averaged over the ranks;
2. ``G /= s``; the Gramian ``G Gᵀ`` is the sum over the ranks of the local partial Gramians
   (one all-reduce of ``K²`` numbers), identical on every rank, and decides finiteness;
3. 2-norm row clipping scales each row by the factor its full norm (from the Gramian's
   diagonal) gives; value clipping acts on each coordinate where it lies;
4. ``Balancer.combine`` with the layout's ``Shard`` gives this rank's columns of the
   single-process update (weighted balancers: the weights from the Gramian, computed alike
   everywhere; the others on their columns, with global sums through ``Shard.reduce``);
5. ``.grad += s·g`` as ``DTensor`` gradients, written last.

Memory per rank: ``K·P/W`` for the buffer. Communication per micro-batch: K all-gathers and K
reduce-scatters of the trunk (``docs/distributed.md``, "Sharded trunks").
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from .._amp import finite_step, unscaled_gramian
from .._sharding import ShardedLayout, is_dtensor
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper, scales_whole_rows
from ..clip._task import TaskValueClip
from ..distributed import all_reduce_grads_and_losses_
from ..gramian import compute_gramian
from ..stats import StepStats
from ..taskgrads import ParamLayout, Passes, TaskRoots
from ._engine import StepInput, combine_or_skip, commit, reject_features, settle
from ._sharded_passes import ShardedWriteBack, sharded_passes, sharded_stats

__all__ = ["ShardedMatrixMode", "check_sharded_clip"]


def check_sharded_clip(clip: RowClipper | None) -> None:
    """2-norm row clippers (:func:`~gradbalance.clip._protocol.scales_whole_rows`) and value
    clipping run sharded."""
    if clip is None or isinstance(clip, TaskValueClip) or scales_whole_rows(clip):
        return
    raise ValueError(
        f"clip={type(clip).__name__} cannot run on a sharded trunk: it needs whole rows of "
        f"the task gradients (norm_type={getattr(clip, 'norm_type', None)}). Use TaskClip or "
        f"TaskAutoClip with norm_type=2, TaskValueClip, or a row clipper declaring "
        f"norm_type = 2.0 and coefficients(norms) -> [K]"
    )


class ShardedMatrixMode:
    """``matrix`` mode over ``DTensor`` parameters: ``G`` ``[K, P_local]`` on each rank."""

    mode: ClassVar[str] = "matrix"

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        self.layout = ShardedLayout(layout.params)
        self.head_params = head_params
        self.plain_heads = [h for h in head_params if not is_dtensor(h)]
        self.passes: Passes = passes
        self.matrix: Tensor | None = None

    def check_backward(self, features: Tensor | None, count: int, reused: bool) -> None:
        reject_features(self.mode, features)

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        balancer.check_shardable()
        check_sharded_clip(clip)

    def backward(self, roots: TaskRoots, first: bool, features: Tensor | None = None) -> None:
        """``G (+)= this rank's columns of the task gradients``; heads ``+=`` their plain
        gradient (one backward pass per task)."""
        k = roots.num_tasks
        if self.matrix is None or self.matrix.shape[0] != k:
            self.matrix = torch.empty(k, self.layout.numel, dtype=self.layout.dtype,
                                      device=self.layout.device)
        sharded_passes(roots, self.layout, self.matrix, accumulate=not first)

    def apply(self, balancer: Balancer, step: StepInput) -> StepStats:
        matrix, losses, scale = self.matrix, step.losses, step.scale
        assert matrix is not None
        shard = self.layout.shard
        if step.group is not None:  # sharded heads were averaged by FSDP2's reduce-scatter
            losses = all_reduce_grads_and_losses_(self.plain_heads, losses, step.group)
        gram = unscaled_gramian(scale, matrix=matrix, shard=shard)
        finite = finite_step(gram, scale, self.head_params, step.group)
        pre_clip = None
        if finite and step.clip is not None:
            pre_clip = torch.diagonal(gram).clamp_min(0).sqrt().to(matrix.dtype)
            _clip_rows(step.clip, matrix, pre_clip)
            gram = shard.sum(compute_gramian(matrix))
        result = combine_or_skip(balancer, matrix, losses, gram, finite, scale, shard)
        vector, weights = result.vector, result.weights
        update = ShardedWriteBack(self.layout, vector, scale)
        finite = settle(update, step, finite)
        stats = sharded_stats(gram, losses, finite, matrix, vector, weights, self.layout,
                              scale, pre_clip_norms=pre_clip, num_backward=step.count)
        commit(update, self.head_params, finite)
        return stats

    def clear(self) -> None:
        """Nothing to drop: ``G`` is overwritten by the next step's first backward."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the passes are always the loop of ordinary backward passes."""


def _clip_rows(clip: RowClipper, matrix: Tensor, norms: Tensor) -> None:
    """Clip the local columns as the clipper would clip the full rows of norms ``norms``."""
    if isinstance(clip, TaskValueClip):  # per coordinate: the same wherever it lies
        clip(matrix)
        return
    coefficients: Tensor = clip.coefficients(norms)  # type: ignore[attr-defined]
    matrix.mul_(coefficients.to(device=matrix.device, dtype=matrix.dtype)[:, None])
