"""The :class:`~gradbalance.modes._layout.Columns` of a trunk sharded with FSDP2: each rank
keeps its ``[K, P/W]``, each task's pass an ordinary ``backward`` that FSDP2 reduce-scatters
(docs/distributed.md, "Sharded trunks (FSDP2)")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._shard import Shard
from .._sharding import ShardedLayout, is_dtensor, local_of
from .._sinks import RowsSink
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper, scales_whole_rows
from ..clip._task import TaskValueClip
from ..distributed import all_reduce_grads_and_losses_
from ..stats import StepStats, build_stats
from ..taskgrads import ParamLayout, Passes, TaskRoots, run_passes
from ._engine import RowsEngine, WriteBack

__all__ = ["ShardedColumns", "ShardedSink", "ShardedWriteBack", "check_replicated_heads",
           "check_sharded_clip"]


@contextlib.contextmanager
def grads_set_aside(params: Sequence[Tensor]) -> Iterator[None]:
    """The trunk's ``.grad`` set aside (None) inside, put back on the way out."""
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g


class ShardedSink(RowsSink):
    """Row ``k`` (+)= this rank's shard of ``.grad`` after task ``k``'s backward, then cleared."""

    by_backward = True

    def __init__(self, layout: ShardedLayout, out: Tensor, accumulate: bool,
                 reached: list[bool] | None = None) -> None:
        super().__init__(layout, out, accumulate, reached)
        self.sharded = layout

    @property
    def inputs(self) -> Sequence[Tensor]:
        return ()

    def write_pass(self, k: int, grads: Sequence[Tensor | None]) -> None:
        super().write_pass(k, [None if p.grad is None else local_of(p.grad)
                               for p in self.sharded.params])
        for p in self.sharded.params:
            p.grad = None

    def write_batched(self, grads: Sequence[Tensor | None]) -> None:
        raise RuntimeError("a sharded trunk's passes run as a loop of backward calls")


def trunk_backward(layout: ShardedLayout, root: Tensor, grad: Tensor | None = None,
                   retain_graph: bool = False, out: Tensor | None = None,
                   accumulate: bool = False) -> Tensor | None:
    """This rank's columns ``[P_local]`` of one backward of ``root`` into ``out``; None when it
    reached no trunk parameter."""
    if out is None:
        out = torch.empty(layout.numel, dtype=layout.dtype, device=layout.device)
    reached = [False] * len(layout.params)
    with grads_set_aside(layout.params):
        torch.autograd.backward(root, grad_tensors=grad, retain_graph=retain_graph)
        ShardedSink(layout, out[None], accumulate, reached).write_pass(0, ())
    return out if any(reached) else None


def check_replicated_heads(head_params: Sequence[Tensor]) -> None:
    """``features`` mode on a sharded trunk needs replicated heads."""
    sharded = [i for i, h in enumerate(head_params) if is_dtensor(h)]
    if sharded:
        raise ValueError(
            f"mode='features' on a sharded trunk needs replicated heads, but "
            f"head_params{sharded[:5]} are DTensors (the heads are under fully_shard); "
            f"shard only the trunk (fully_shard(model.trunk)) or use mode='matrix'"
        )


def check_sharded_clip(clip: RowClipper | None) -> None:
    """Only 2-norm row clippers that scale whole rows and value clipping run sharded."""
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
        """K ordinary backward passes (the heads' plain gradient with them)."""
        reached = [False] * len(self.layout.params)
        with grads_set_aside(self.layout.params):
            run_passes(roots, [ShardedSink(self.layout, out, not first, reached)],
                       self.device, passes="loop")
        if not any(reached):
            raise RuntimeError(
                "no task's backward pass wrote a gradient into the sharded trunk: FSDP2's "
                "gradient sync is off (model.set_requires_gradient_sync(False)) or the losses "
                "do not depend on the trunk. Keep the sync on during buf.backward (the buffer "
                "accumulates micro-batches itself: each pass reduce-scatters its task's "
                "gradient); nothing was written"
            )

    def reduce_(self, matrix: Tensor, losses: Tensor, heads: Sequence[Tensor],
                group: Any) -> Tensor:
        """The losses and the replicated heads (FSDP2 averaged the rest)."""
        return all_reduce_grads_and_losses_(self.plain_heads, losses, group)

    def clip_(self, clip: RowClipper, matrix: Tensor, gram: Tensor) -> Tensor:
        """Row factors from the full norms (the Gramian's diagonal); value clipping in place."""
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
        """Refuse a leaf; the trunk's use is told by the backward (:meth:`features_update`)."""
        if features.grad_fn is None:
            raise ValueError(
                f"features (shape {tuple(features.shape)}) is a leaf tensor, not computed "
                f"from the sharded trunk; pass the trunk's output, e.g. "
                f"feats = model.trunk(x); buf.backward(losses, features=feats)"
            )

    def reused_backward(self, weights: Tensor, roots: TaskRoots, heads: Sequence[Tensor],
                        held: Tensor | None) -> Tensor:
        """The trunk's shard of ``Σₖ wₖ ∂Lₖ/∂θ``; the heads' plain gradient completed by a
        backward of ``Σₖ (1 − wₖ) s·Lₖ``."""
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
                      group: Any) -> tuple[WriteBack, Tensor]:
        assert held is not None
        if group is not None:
            losses = all_reduce_grads_and_losses_(self.plain_heads, losses, group)
        return ShardedWriteBack(self.layout, held, None), losses


class ShardedWriteBack(WriteBack):
    """A sharded trunk's ``WriteBack``: a new ``DTensor`` ``.grad``, or ``+=`` on its shard."""

    def __init__(self, layout: ShardedLayout, vector: Tensor, scale: Tensor | None) -> None:
        from torch.distributed.tensor import DTensor

        super().__init__([], [], scale, flat=vector)
        self.dtype = layout.dtype
        factor = None if scale is None else scale.to(device=vector.device, dtype=vector.dtype)
        for (p, start, stop), shape in zip(layout.slices(), layout.local_shapes):
            part = vector[start:stop].reshape(shape)
            if factor is not None:
                part = part * factor
            part = part.to(p.dtype)
            if p.grad is None:
                meta: Any = p
                new = DTensor.from_local(part.clone() if factor is None else part,
                                         meta.device_mesh, meta.placements, run_check=False,
                                         shape=p.shape, stride=p.stride())
                self.assign.append((p, new))
            else:
                self.add.append((p, part))

    @staticmethod
    def local(grad: Tensor) -> Tensor:
        return local_of(grad)
