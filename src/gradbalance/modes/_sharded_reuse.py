"""``update_every`` on a trunk sharded with FSDP2: a step that reuses the cached weights.

The trunk's ``Σₖ wₖ ∂Lₖ/∂θ`` comes from one ordinary backward of ``Σₖ wₖ s·Lₖ`` (FSDP2
reduce-scatters it, this rank keeps its shard); the heads need their plain gradient of
``Σₖ Lₖ``, so a second backward of ``Σₖ (1 − wₖ) s·Lₖ`` completes it (through the heads only
when they are replicated; through the trunk too when FSDP2 shards them, the trunk's part of
that pass discarded). As on an unsharded trunk, the update is held until ``apply_`` and written
last (:class:`~gradbalance.modes._amortize.ReusedStep`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._sharding import ShardedLayout, is_dtensor
from ..distributed import all_reduce_grads_and_losses_
from ..stats import StepStats
from ..taskgrads import TaskRoots
from ._amortize import WeightCache, commit_reused
from ._engine import StepInput
from ._sharded_passes import ShardedWriteBack, grads_set_aside, trunk_backward

__all__ = ["ShardedReusedStep"]


class ShardedReusedStep:
    """:class:`~gradbalance.modes._amortize.ReusedStep` over ``DTensor`` parameters."""

    def __init__(self, layout: ShardedLayout, head_params: Sequence[Tensor]) -> None:
        self.layout = layout
        self.plain_heads = [h for h in head_params if not is_dtensor(h)]
        self.sharded_heads = len(self.plain_heads) < len(head_params)
        self.held: Tensor | None = None  # this rank's columns of s·Σₖ wₖ ∂Lₖ/∂θ

    def backward(self, weights: Tensor, roots: TaskRoots, shared: Sequence[Tensor],
                 head_params: Sequence[Tensor]) -> None:
        scaled = roots.scaled
        w = weights.to(dtype=scaled.dtype, device=scaled.device)
        held = torch.empty(self.layout.numel, dtype=self.layout.dtype,
                           device=self.layout.device) if self.held is None else self.held
        trunk_backward(self.layout, (w * scaled).sum(), retain_graph=True, out=held,
                       accumulate=self.held is not None)
        rest = ((1 - w) * scaled).sum()
        with grads_set_aside(self.layout.params):  # the trunk's part of it is discarded
            if self.sharded_heads:
                torch.autograd.backward(rest)
            elif self.plain_heads:
                torch.autograd.backward(rest, inputs=self.plain_heads)
        self.held = held

    def finish(self, cache: WeightCache, step: StepInput, shared: Sequence[Tensor],
               head_params: Sequence[Tensor], mode: str) -> StepStats:
        """Average the losses and replicated heads over the ranks, check (one host sync),
        write."""
        held = self.held
        self.held = None
        assert held is not None
        losses = step.losses
        if step.group is not None:
            losses = all_reduce_grads_and_losses_(self.plain_heads, losses, step.group)
        update = ShardedWriteBack(self.layout, held, None)
        return commit_reused(update, cache, step, losses, head_params, mode)

    def clear(self) -> None:
        self.held = None
