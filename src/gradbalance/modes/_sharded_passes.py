"""The K task passes and the write-back on a trunk sharded with FSDP2.

Under ``fully_shard`` the trunk's ``DTensor`` parameters never enter the autograd graph (the
forward uses their all-gathered copies), so ``autograd.grad`` cannot target them. Each task's
pass is therefore an ordinary ``backward`` from the task's own loss: FSDP2's hooks all-gather
the parameters where they were resharded and reduce-scatter the gradient into the sharded
``.grad`` (the mean over the ranks, i.e. the full batch's gradient). The pass's local shard is
moved into row ``k`` of the ``[K, P_local]`` buffer and ``.grad`` cleared for the next task; the
trunk's ``.grad`` from before the step is set aside during the passes and put back after them.
The heads receive every pass's ``∂Lₖ/∂h``, so their ``.grad`` gains ``∂(Σₖ Lₖ)/∂h`` once,
their plain gradient (reduce-scattered too when the heads are sharded).

The update goes back as ``DTensor`` gradients with the parameters' placements
(:class:`ShardedWriteBack`), built in full before anything is written.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

from .._sharding import ShardedLayout, local_of
from ..taskgrads import TaskRoots

__all__ = ["ShardedWriteBack", "grads_set_aside", "sharded_passes", "trunk_backward"]


def task_backward(roots: TaskRoots, k: int, retain_graph: bool) -> bool:
    """``backward`` of task ``k``'s scaled loss (from its own root); False for a constant
    loss (no pass)."""
    if roots.outputs is None:
        torch.autograd.backward(roots.scaled[k], retain_graph=retain_graph)
        return True
    root = roots.outputs[k]
    if root is None:
        return False
    torch.autograd.backward(root, grad_tensors=roots.grad_outputs[k].reshape(()),
                            retain_graph=retain_graph)
    return True


def _write_row(row: Tensor, grads: Sequence[Tensor | None], layout: ShardedLayout,
               accumulate: bool) -> None:
    for g, (_, start, stop) in zip(grads, layout.slices()):
        part = row[start:stop]
        if g is None:
            if not accumulate:
                part.zero_()
        elif accumulate:
            part.add_(g.reshape(-1))
        else:
            part.copy_(g.reshape(-1))


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


def trunk_backward(layout: ShardedLayout, root: Tensor, grad: Tensor | None = None,
                   retain_graph: bool = False, out: Tensor | None = None,
                   accumulate: bool = False) -> Tensor | None:
    """This rank's columns ``[P_local]`` of one ordinary backward of ``root`` (``grad``: its
    ``grad_tensors``) into ``out`` (``+=`` with ``accumulate``), the trunk's ``.grad`` set
    aside meanwhile; None when the pass reached no trunk parameter."""
    if out is None:
        out = torch.empty(layout.numel, dtype=layout.dtype, device=layout.device)
    with grads_set_aside(layout.params):
        torch.autograd.backward(root, grad_tensors=grad, retain_graph=retain_graph)
        grads = layout.local_grads()
        _write_row(out, grads, layout, accumulate)
    return out if any(g is not None for g in grads) else None


def sharded_passes(roots: TaskRoots, layout: ShardedLayout, out: Tensor, accumulate: bool,
                   retain_graph: bool = False) -> None:
    """``out[k] (+)=`` this rank's columns of task ``k``'s full-batch gradient, for every k.

    Raises (after putting the trunk's ``.grad`` back) when no task reached any trunk
    parameter: FSDP2's gradient sync is off (``set_requires_gradient_sync(False)``), so the
    reduce-scatter that fills the sharded ``.grad`` did not run.
    """
    params = layout.params
    reached = False
    with grads_set_aside(params):
        k_total = roots.num_tasks
        for k in range(k_total):
            keep = retain_graph or k < k_total - 1
            ran = task_backward(roots, k, keep)
            grads = layout.local_grads() if ran else [None] * len(params)
            reached = reached or any(g is not None for g in grads)
            _write_row(out[k], grads, layout, accumulate)
            for p in params:
                p.grad = None
    if not reached:
        raise RuntimeError(
            "no task's backward pass wrote a gradient into the sharded trunk: FSDP2's gradient "
            "sync is off (model.set_requires_gradient_sync(False)) or the losses do not depend "
            "on the trunk. Keep the sync on during buf.backward (the buffer accumulates "
            "micro-batches itself: each pass reduce-scatters its task's gradient); nothing "
            "was written"
        )


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
