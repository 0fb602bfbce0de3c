"""The columns of a trunk sharded with FSDP2 (:class:`~gradbalance.modes._layout.Columns`):
each rank keeps its own ``[K, P/W]``.

Per micro-batch, K ordinary backward passes (one per task, from its own loss) let FSDP2
reduce-scatter each task's gradient; this rank's shard of it is added into row ``k`` of the
local buffer (:func:`~gradbalance.modes._sharded_passes.sharded_passes`). Once per step:

1. the losses and the heads' plain ``.grad`` (unless FSDP2 already averaged them, when the
   heads are sharded too) are averaged over the ranks;
2. ``G /= s``; the Gramian ``G Gᵀ`` is the sum over the ranks of the local partial Gramians
   (one all-reduce of ``K²`` numbers), identical on every rank, and decides finiteness;
3. 2-norm row clipping scales each row by the factor its full norm (from the Gramian's
   diagonal) gives; value clipping acts on each coordinate where it lies;
4. ``Balancer.combine`` with this layout's ``Shard`` gives this rank's columns of the
   single-process update (weighted balancers: the weights from the Gramian, computed alike
   everywhere; the others on their columns, with global sums through ``Shard.reduce``);
5. ``.grad += s·g`` as ``DTensor`` gradients, written last.

``features`` mode takes the feature gradients through replicated heads and all-gathers them
as under data parallelism; the trunk's update is one ordinary backward of ``⟨f, W·s·z_r⟩``
from this rank's features ``f`` and its columns ``z_r`` of the balanced gradient: FSDP2's
reduce-scatter averages it over the ranks, which gives this rank's shard of
``Σ_r ∂⟨f_r, s·z_r⟩/∂θ``, the single-process trunk gradient.

Memory per rank: ``K·P/W`` for the buffer. Communication per micro-batch: K all-gathers and K
reduce-scatters of the trunk (``docs/distributed.md``, "Sharded trunks").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._shard import Shard
from .._sharding import ShardedLayout, is_dtensor
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper, scales_whole_rows
from ..clip._task import TaskValueClip
from ..distributed import all_reduce_grads_and_losses_
from ..stats import StepStats, build_stats
from ..taskgrads import ParamLayout, Passes, TaskRoots
from ._engine import RowsEngine, Update
from ._sharded_passes import ShardedWriteBack, grads_set_aside, sharded_passes, trunk_backward

__all__ = ["ShardedColumns", "check_replicated_heads", "check_sharded_clip"]


def check_replicated_heads(head_params: Sequence[Tensor]) -> None:
    """``features`` mode on a sharded trunk takes the feature gradients through the heads,
    which must stay replicated (not under ``fully_shard``)."""
    sharded = [i for i, h in enumerate(head_params) if is_dtensor(h)]
    if sharded:
        raise ValueError(
            f"mode='features' on a sharded trunk needs replicated heads, but "
            f"head_params{sharded[:5]} are DTensors (the heads are under fully_shard); "
            f"shard only the trunk (fully_shard(model.trunk)) or use mode='matrix'"
        )


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


class ShardedColumns:
    """This rank's columns of a trunk of ``DTensor`` parameters (``fully_shard``)."""

    def __init__(self, layout: ParamLayout, head_params: Sequence[Tensor],
                 passes: Passes) -> None:
        if passes == "batched":
            raise ValueError(
                "passes='batched' cannot run on a trunk sharded with fully_shard (FSDP2 "
                "gathers and reduces each backward pass itself); use passes='auto' or 'loop'"
            )
        self.layout = ShardedLayout(layout.params)
        self.shard: Shard | None = self.layout.shard
        self.numel, self.dtype, self.device = (self.layout.numel, self.layout.dtype,
                                               self.layout.device)
        self.plain_heads = [h for h in head_params if not is_dtensor(h)]

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        balancer.check_shardable()
        check_sharded_clip(clip)

    def task_passes(self, engine: RowsEngine, roots: TaskRoots, out: Tensor,
                    first: bool) -> None:
        """K ordinary backward passes (the heads get their plain gradient from them)."""
        sharded_passes(roots, self.layout, out, accumulate=not first)

    def reduce_(self, matrix: Tensor, losses: Tensor, heads: Sequence[Tensor],
                group: Any) -> Tensor:
        """The losses and the replicated heads (FSDP2 averaged the rest)."""
        return all_reduce_grads_and_losses_(self.plain_heads, losses, group)

    def clip_(self, clip: RowClipper, matrix: Tensor, gram: Tensor) -> Tensor:
        """Each row scaled by the factor its full norm (the Gramian's diagonal) gives;
        value clipping where each coordinate lies."""
        norms = torch.diagonal(gram).clamp_min(0).sqrt().to(matrix.dtype)
        if isinstance(clip, TaskValueClip):
            clip(matrix)
        else:
            coefficients: Tensor = clip.coefficients(norms)  # type: ignore[attr-defined]
            matrix.mul_(coefficients.to(device=matrix.device, dtype=matrix.dtype)[:, None])
        return norms

    def write_back(self, vector: Tensor, scale: Tensor | None,
                   reached: Sequence[bool] | None) -> ShardedWriteBack:
        return ShardedWriteBack(self.layout, vector, scale)

    def stats(self, gram: Tensor, losses: Tensor, finite: bool, **fields: Any) -> StepStats:
        return build_stats(gram, losses, finite, shard=self.shard, **fields)

    def features_update(self, features: Tensor, grad: Tensor, group: Any) -> ShardedWriteBack:
        """One ordinary backward of ``⟨features, W·grad⟩`` (FSDP2 reduce-scatters it)."""
        size = 1 if group is None else dist.get_world_size(group)
        grad = (grad * size).view_as(features).to(features.dtype)
        flat = trunk_backward(self.layout, features, grad)
        if flat is None:
            raise ValueError(
                f"features (shape {tuple(features.shape)}) is not computed from the sharded "
                f"trunk (or FSDP2's gradient sync is off): its backward wrote no trunk "
                f"gradient; pass the trunk's output, e.g. feats = model.trunk(x)"
            )
        return ShardedWriteBack(self.layout, flat, None)

    def check_features(self, features: Tensor) -> None:
        """FSDP2's forward uses gathered copies of the parameters, so whether the trunk lies
        on ``features``' graph is told by its backward (:meth:`features_update`); a leaf is
        refused here."""
        if features.grad_fn is None:
            raise ValueError(
                f"features (shape {tuple(features.shape)}) is a leaf tensor, not computed "
                f"from the sharded trunk; pass the trunk's output, e.g. "
                f"feats = model.trunk(x); buf.backward(losses, features=feats)"
            )

    def reused_backward(self, weights: Tensor, roots: TaskRoots, heads: Sequence[Tensor],
                        held: Tensor | None) -> Tensor:
        """The trunk's ``Σₖ wₖ ∂Lₖ/∂θ`` from one ordinary backward of ``Σₖ wₖ s·Lₖ`` (FSDP2
        reduce-scatters it, this rank keeps its shard); the heads' plain gradient of
        ``Σₖ Lₖ`` completed by a second backward of ``Σₖ (1 − wₖ) s·Lₖ`` (through the heads
        only when they are replicated; through the trunk too when FSDP2 shards them, the
        trunk's part of that pass discarded)."""
        scaled = roots.scaled
        w = weights.to(dtype=scaled.dtype, device=scaled.device)
        out = torch.empty(self.numel, dtype=self.dtype, device=self.device) if held is None \
            else held
        trunk_backward(self.layout, (w * scaled).sum(), retain_graph=True, out=out,
                       accumulate=held is not None)
        rest = ((1 - w) * scaled).sum()
        with grads_set_aside(self.layout.params):
            if len(self.plain_heads) < len(heads):
                torch.autograd.backward(rest)
            elif self.plain_heads:
                torch.autograd.backward(rest, inputs=self.plain_heads)
        return out

    def reused_update(self, held: Tensor | None, losses: Tensor, heads: Sequence[Tensor],
                      group: Any) -> tuple[Update, Tensor]:
        """The losses and the replicated heads averaged over the ranks (FSDP2 averaged the
        rest)."""
        assert held is not None
        if group is not None:
            losses = all_reduce_grads_and_losses_(self.plain_heads, losses, group)
        return ShardedWriteBack(self.layout, held, None), losses
