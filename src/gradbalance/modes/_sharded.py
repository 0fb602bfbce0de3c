"""The columns of a trunk sharded with FSDP2 (:class:`~gradbalance.modes._layout.Columns`):
each rank keeps its own ``[K, P/W]``.

Under ``fully_shard`` the trunk's ``DTensor`` parameters never enter the autograd graph (the
forward uses their all-gathered copies), so ``autograd.grad`` cannot target them. Per
micro-batch, :func:`~gradbalance.taskgrads.run_passes` runs each task's pass as an ordinary
``backward`` from its own loss into a :class:`ShardedSink`: FSDP2 reduce-scatters the task's
gradient into the sharded ``.grad`` (the full batch's), whose local shard is added into row
``k`` of the local buffer, ``.grad`` cleared for the next task; the trunk's ``.grad`` from
before the step is set aside meanwhile (:func:`grads_set_aside`). The heads receive every
pass's ``∂Lₖ/∂h``, so their ``.grad`` gains their plain gradient once. Once per step:

1. the losses and the heads' plain ``.grad`` (unless FSDP2 already averaged them, when the
   heads are sharded too) are averaged over the ranks;
2. ``G /= s``; the Gramian ``G Gᵀ`` is the sum over the ranks of the local partial Gramians
   (one all-reduce of ``K²`` numbers), identical on every rank, and decides finiteness;
3. 2-norm row clipping scales each row by the factor its full norm (from the Gramian's
   diagonal) gives; value clipping acts on each coordinate where it lies;
4. ``Balancer.combine`` with this layout's ``Shard`` gives this rank's columns of the
   single-process update (weighted balancers: the weights from the Gramian, computed alike
   everywhere; the others on their columns, with global sums through ``Shard.reduce``);
5. ``.grad += s·g`` as ``DTensor`` gradients with the parameters' placements, written last
   (:class:`ShardedWriteBack`).

``features`` mode takes the feature gradients through replicated heads and all-gathers them
as under data parallelism; the trunk's update is one ordinary backward of ``⟨f, W·s·z_r⟩``
from this rank's features ``f`` and its columns ``z_r`` of the balanced gradient: FSDP2's
reduce-scatter averages it over the ranks, which gives this rank's shard of
``Σ_r ∂⟨f_r, s·z_r⟩/∂θ``, the single-process trunk gradient.

Memory per rank: ``K·P/W`` for the buffer. Communication per micro-batch: K all-gathers and K
reduce-scatters of the trunk (``docs/distributed.md``, "Sharded trunks").
"""

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
from ._engine import RowsEngine, Update

__all__ = ["ShardedColumns", "ShardedSink", "ShardedWriteBack", "check_replicated_heads",
           "check_sharded_clip"]


@contextlib.contextmanager
def grads_set_aside(params: Sequence[Tensor]) -> Iterator[None]:
    """The trunk's ``.grad`` set aside (None) inside, put back on the way out, also on a
    failure: the passes' gradients never mix with the user's."""
    saved = [p.grad for p in params]
    try:
        for p in params:
            p.grad = None
        yield
    finally:
        for p, g in zip(params, saved):
            p.grad = g


class ShardedSink(RowsSink):
    """Row ``k`` (+)= this rank's shard of ``.grad`` after task ``k``'s ordinary backward,
    which is then cleared (:mod:`gradbalance._sinks`, ``by_backward``)."""

    by_backward = True

    def __init__(self, layout: ShardedLayout, out: Tensor, accumulate: bool,
                 reached: list[bool] | None = None) -> None:
        super().__init__(layout, out, accumulate, reached)
        self.sharded = layout

    @property
    def inputs(self) -> Sequence[Tensor]:
        return ()

    def write_pass(self, k: int, grads: Sequence[Tensor | None]) -> None:
        super().write_pass(k, self.sharded.local_grads())
        for p in self.sharded.params:
            p.grad = None

    def write_batched(self, grads: Sequence[Tensor | None]) -> None:
        raise RuntimeError("a sharded trunk's passes run as a loop of backward calls")


def trunk_backward(layout: ShardedLayout, root: Tensor, grad: Tensor | None = None,
                   retain_graph: bool = False, out: Tensor | None = None,
                   accumulate: bool = False) -> Tensor | None:
    """This rank's columns ``[P_local]`` of one ordinary backward of ``root`` (``grad``: its
    ``grad_tensors``) into ``out`` (``+=`` with ``accumulate``), the trunk's ``.grad`` set
    aside meanwhile; None when the pass reached no trunk parameter."""
    if out is None:
        out = torch.empty(layout.numel, dtype=layout.dtype, device=layout.device)
    reached = [False] * len(layout.params)
    with grads_set_aside(layout.params):
        torch.autograd.backward(root, grad_tensors=grad, retain_graph=retain_graph)
        ShardedSink(layout, out[None], accumulate, reached).write_pass(0, ())
    return out if any(reached) else None


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
        """K ordinary backward passes (the heads get their plain gradient from them).

        Raises (after putting the trunk's ``.grad`` back) when no task reached any trunk
        parameter: FSDP2's gradient sync is off (``set_requires_gradient_sync(False)``), so
        the reduce-scatter that fills the sharded ``.grad`` did not run.
        """
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


class ShardedWriteBack:
    """A step's update of a sharded trunk (:class:`~gradbalance.modes._engine.WriteBack`'s
    interface): ``.grad = s·g`` as a new ``DTensor`` with the parameter's mesh and placements
    where there was none, ``.grad += s·g`` on the local shard elsewhere; every tensor made
    here, so :meth:`commit_` only assigns and adds."""

    def __init__(self, layout: ShardedLayout, vector: Tensor, scale: Tensor | None) -> None:
        from torch.distributed.tensor import DTensor

        self.scale = scale
        self.flat = vector
        self.dtype = layout.dtype
        self.assign: list[tuple[Tensor, Tensor]] = []
        self.add: list[tuple[Tensor, Tensor]] = []
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

    @property
    def params(self) -> list[Tensor]:
        return [p for p, _ in self.assign] + [p for p, _ in self.add]

    def bound(self) -> Tensor:
        """The largest magnitude of this rank's part of the update before the scale (0-d
        float64, NaN if any); :func:`~gradbalance.modes._engine.settle` agrees it over the
        ranks."""
        if self.flat.numel() == 0:
            return torch.zeros((), dtype=torch.float64)
        low, high = torch.aminmax(self.flat)
        return torch.maximum(high, -low).to(torch.float64)

    def commit_(self) -> None:
        for p, new in self.assign:
            p.grad = new
        for p, part in self.add:
            grad = p.grad
            assert grad is not None
            local_of(grad).add_(part)
