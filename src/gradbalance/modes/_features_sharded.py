"""``features`` mode on a trunk sharded with FSDP2.

The feature gradients ``[K, B·D]`` are taken through the heads, which must stay replicated
(not under ``fully_shard``); every rank all-gathers them and balances the full batch's
matrix, as under data parallelism (:mod:`gradbalance.modes._features`). The trunk's update
is one ordinary backward of ``⟨f, W·s·z_r⟩`` from this rank's features ``f`` and its columns
``z_r`` of the balanced gradient: FSDP2's reduce-scatter averages it over the ranks, which
gives this rank's shard of ``Σ_r ∂⟨f_r, s·z_r⟩/∂θ``, the single-process trunk gradient. It is
computed in full (the trunk's ``.grad`` set aside meanwhile) before it is written.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._sharding import ShardedLayout, is_dtensor
from ..taskgrads import ParamLayout, Passes
from ._engine import StepInput
from ._features import FeaturesMode
from ._sharded_passes import ShardedWriteBack, _write_row

__all__ = ["ShardedFeaturesMode"]


class ShardedFeaturesMode(FeaturesMode):
    """``features`` mode over ``DTensor`` trunk parameters; replicated heads."""

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        sharded = [i for i, h in enumerate(head_params) if is_dtensor(h)]
        if sharded:
            raise ValueError(
                f"mode='features' on a sharded trunk needs replicated heads, but "
                f"head_params{sharded[:5]} are DTensors (the heads are under fully_shard); "
                f"shard only the trunk (fully_shard(model.trunk)) or use mode='matrix'"
            )
        super().__init__(layout, head_params, passes, modules)
        self.sharded = ShardedLayout(layout.params)

    def check_backward(self, features: Tensor | None, count: int, reused: bool) -> None:
        if reused or count > 0 or not isinstance(features, Tensor) or (
                features.grad_fn is None):
            super().check_backward(features, count, reused)  # the unsharded checks and texts
        # FSDP2's forward uses gathered copies of the parameters, so whether the trunk lies
        # on ``features``' graph is checked after its backward instead (_trunk_update).

    def _trunk_update(self, features: Tensor, grad: Tensor,
                      step: StepInput) -> ShardedWriteBack:
        import torch.distributed as dist

        size = 1 if step.group is None else dist.get_world_size(step.group)
        if step.scale is not None:
            grad = grad * step.scale.to(grad.dtype)
        grad = (grad * size).view_as(features).to(features.dtype)
        layout = self.sharded
        params = layout.params
        saved = [p.grad for p in params]
        flat = torch.empty(1, layout.numel, dtype=layout.dtype, device=layout.device)
        try:
            for p in params:
                p.grad = None
            torch.autograd.backward(features, grad_tensors=grad)
            grads = layout.local_grads()
            reached = any(g is not None for g in grads)
            _write_row(flat[0], grads, layout, accumulate=False)
        finally:
            for p, g in zip(params, saved):
                p.grad = g
        if not reached:
            raise ValueError(
                f"features (shape {tuple(features.shape)}) is not computed from the sharded "
                f"trunk (or FSDP2's gradient sync is off): its backward wrote no trunk "
                f"gradient; pass the trunk's output, e.g. feats = model.trunk(x)"
            )
        return ShardedWriteBack(layout, flat[0], None)
