"""The :class:`~gradbalance.modes._layout.Columns` of an unsharded trunk."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._graph import reaches
from .._shard import Shard
from .._sparse import dense_all
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper
from ..distributed import all_reduce_grads_and_losses_, all_reduce_mean_
from ..stats import StepStats, build_stats
from ..taskgrads import ParamLayout, TaskRoots
from ._engine import RowsEngine, WriteBack, heads_backward_, owned_grads

__all__ = ["LocalColumns"]


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
        heads = heads_backward_(roots, engine.head_params)
        engine.compute(roots, self.layout, out, accumulate=not first, reached=engine.reached)
        heads.accumulate_()

    def reduce_(self, matrix: Tensor, losses: Tensor, heads: Sequence[Tensor],
                group: Any) -> Tensor:
        return all_reduce_grads_and_losses_(heads, losses, group, matrix=matrix)

    def clip_(self, clip: RowClipper, matrix: Tensor, gram: Tensor) -> Tensor:
        return clip(matrix)

    def write_back(self, vector: Tensor, scale: Tensor | None,
                   reached: Sequence[bool] | None) -> WriteBack:
        return WriteBack.from_flat(self.layout, vector, scale, reached)

    def stats(self, gram: Tensor, losses: Tensor, finite: bool, **fields: Any) -> StepStats:
        return build_stats(gram, losses, finite, **fields)

    def features_update(self, features: Tensor, grad: Tensor, group: Any) -> WriteBack:
        """One ``autograd.grad``; data-parallel, the mean of the ranks' parts."""
        params = self.layout.params
        grad = grad.view_as(features).to(features.dtype)
        if group is not None:
            grad = grad * dist.get_world_size(group)
        parts = dense_all(torch.autograd.grad(features, params, grad, allow_unused=True))
        if group is not None:
            full = [torch.zeros_like(p) if g is None else g for p, g in zip(params, parts)]
            all_reduce_mean_(full, group)
            parts = list(full)
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

    def reused_backward(self, weights: Tensor, roots: TaskRoots, heads: Sequence[Tensor],
                        held: list[Tensor | None] | None) -> list[Tensor | None]:
        head_grads = heads_backward_(roots, heads)
        scaled = roots.scaled
        total = (weights.to(dtype=scaled.dtype, device=scaled.device) * scaled).sum()
        grads = dense_all(torch.autograd.grad(total, self.layout.params, allow_unused=True))
        head_grads.accumulate_()
        if held is None:
            owned = owned_grads(grads)
            return [g if g is None or ok else g.clone() for g, ok in zip(grads, owned)]
        for i, g in enumerate(grads):
            if g is not None:
                part = held[i]
                held[i] = g.clone() if part is None else part.add_(g)
        return held

    def reused_update(self, held: list[Tensor | None] | None, losses: Tensor,
                      heads: Sequence[Tensor], group: Any) -> tuple[WriteBack, Tensor]:
        """Data-parallel: the held gradients, heads and losses averaged in one collective."""
        params = self.layout.params
        grads: list[Tensor | None] = [None] * len(params) if held is None else list(held)
        if group is not None:
            full = [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]
            losses = all_reduce_grads_and_losses_(heads, losses, group, also=full)
            grads = list(full)
        return WriteBack(params, grads, owned=[True] * len(grads)), losses
