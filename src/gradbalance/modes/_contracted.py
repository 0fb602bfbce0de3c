"""``gramian`` mode's batched passes contracted inside the backward: one vmapped backward over
the K tasks (``is_grads_batched``) in which a tensor hook on each recorded linear layer's
output takes its ``[K, N, o]`` gradients, adds the layer's block of ``G Gᵀ`` by its route and
drops them, so the passes hold one layer's gradients and ``[K, K]`` rather than every layer's
operands; the graph is kept for the write-back, one backward of ``Σₖ wₖ Lₖ``
(docs/performance.md, "Modes"). The hooks are :mod:`.._per_sample_eager`'s (per-sample
route); a block without exact recorded calls gives its ``[K, P_b]`` rows, contracted at the
end of the call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from .._per_sample_eager import Slots, lowest
from .._sinks import StackSink, task_stack
from ..gramian import compute_gramian, linear_gramian
from ..taskgrads import Concrete, Passes, TaskRoots, batched_grads, run_passes
from ._blocks import Block, Call
from ._engine import WriteBack
from ._layers import rows_grad, rows_input

__all__ = ["ContractedStep", "contract_passes"]


@dataclass
class ContractedStep:
    """A micro-batch whose Gramian its batched passes formed: the graph's roots (kept for the
    write-back), the calls of each linear block, and the passes, should the step need the
    operands after all (a second micro-batch, a process group)."""

    roots: TaskRoots
    gram: Tensor
    calls: list[list[Call]]
    passes: Passes
    preferred: Concrete | None

    def weighted_update(self, params: Sequence[Tensor], weights: Tensor) -> WriteBack:
        """``Σₖ wₖ ∂(s·Lₖ)/∂θ`` by one backward through the kept graph, nothing written."""
        scaled = self.roots.scaled
        try:
            parts = torch.autograd.grad(scaled, list(params),
                                        grad_outputs=weights.to(scaled.dtype), allow_unused=True)
        except RuntimeError as error:
            if "second time" not in str(error):
                raise
            raise RuntimeError(_FREED) from error
        return WriteBack(params, parts, owned=[True] * len(parts))


#: A backward between ``backward()`` and ``apply_()`` freed the graph the write-back needs.
_FREED = (
    "mode='gramian' contracted this step's passes and keeps the losses' graph until apply_() "
    "for its write-back, but a backward through that graph since backward() (e.g. "
    "aux_loss.backward() on the same forward) freed it; run that backward before "
    "buf.backward(), or with retain_graph=True. The step is dropped"
)


class _Hooks:
    """A :class:`Slots` per hooked block, each block contracted into ``gram`` once full."""

    def __init__(self, blocks: Sequence[Block], k_total: int, gram: Tensor) -> None:
        self.k_total = k_total
        self.unbatched = False  # a hook saw a gradient outside a batched pass
        self.slots = [Slots(1, len(block.calls), partial(_contract, block, list(block.calls),
                                                         k_total, gram))
                      for block in blocks]
        self.handles: list[Any] = []
        for block, slots in zip(blocks, self.slots):
            for call, recorded in enumerate(block.calls):
                assert recorded.output is not None
                self.handles.append(recorded.output.register_hook(  # type: ignore[no-untyped-call]
                    self._hook(slots.hook(call))))

    def _hook(self, take: Callable[[Tensor], None]) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:
            stack = task_stack(grad, self.k_total)
            if stack is None:
                self.unbatched = True
            else:
                take(stack)
        return hook

    def finish(self) -> None:
        for slots in self.slots:  # outputs off the graph: no block
            slots.finish()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _contract(block: Block, calls: list[Call], k_total: int, gram: Tensor,
              grads: list[list[Tensor | None]]) -> None:
    """``block``'s ``G_b G_bᵀ`` from its calls' inputs and output gradients ``[K, *y]``, added
    to ``gram`` (by the block's route, as :meth:`Block.operands` would give them)."""
    mod = block.module_layer()
    dtype = torch.promote_types(mod.weight.dtype, torch.float32)
    xs, ds = [], []
    for call, d in zip(calls, grads[0]):
        if d is not None:
            assert call.input is not None
            xs.append(rows_input(mod, call.input.detach()).to(dtype))
            ds.append(rows_grad(mod, d, k_total).to(dtype))
    grads.clear()
    if ds:
        x = xs[0] if len(xs) == 1 else torch.cat(xs)
        d = ds[0] if len(ds) == 1 else torch.cat(ds, dim=1)
        del xs, ds
        weight, bias = block.linear_params()
        gram += linear_gramian(x, d, weight, bias, route=block.route)


def _from_cut(roots: TaskRoots, cut: Sequence[Tensor]
              ) -> tuple[list[Tensor], list[Tensor]]:
    """``cut`` (the tensors some task reaches) and its ``[K, *y]`` gradients, by K passes
    that each cross one task's head (:mod:`._cut`)."""
    sink = StackSink(cut, roots.num_tasks)
    run_passes(roots, [sink], roots.scaled.device, passes="loop", retain_graph=True)
    found = [(y, g) for y, g in zip(cut, sink.stacks) if g is not None]
    return [y for y, _ in found], [g for _, g in found]


def _asked_outputs(hooked: Sequence[Block], tops: Sequence[Tensor]) -> list[Tensor]:
    """The hooked calls' outputs the batched call must return: the lowest ones below ``tops``
    (the hooks see the others' gradients on the way down)."""
    outputs = [call.output for block in hooked for call in block.calls
               if call.output is not None]
    return [y for y, low in zip(outputs, lowest(tops, outputs)) if low]


def _add_row_blocks(gram: Tensor, rest: list[Tensor | None], k_total: int) -> None:
    """Adds each ``[K, P_b]`` block's Gramian to ``gram``, dropping each block once added."""
    while rest:
        g = rest.pop(0)
        if g is not None:
            gram += compute_gramian(g.reshape(k_total, -1))


def contract_passes(roots: TaskRoots, hooked: Sequence[Block], rows: Sequence[Block],
                    passes: Passes, cut: Sequence[Tensor] | None = None
                    ) -> tuple[Tensor | None, bool]:
    """``G Gᵀ`` ``[K, K]`` float64 of one batched call, the graph kept: ``hooked`` blocks (exact
    linear layers with their calls kept) contracted inside it, the ``rows`` blocks' ``[K, P_b]``
    after it. The call starts at ``cut`` where given (:mod:`._cut`), else at the losses.
    ``(None, ran)`` where it could not: the batched call failed (``ran`` False, the loop is
    next) or this torch hid its batched gradients from the hooks."""
    k_total = roots.num_tasks
    gram = torch.zeros(k_total, k_total, dtype=torch.float64, device=roots.scaled.device)
    start = None if cut is None else _from_cut(roots, cut)  # before the hooks: not batched
    asked = _asked_outputs(hooked, [roots.scaled] if start is None else start[0])
    inputs = [*asked, *(p for block in rows for p in block.params)]
    hooks = _Hooks(hooked, k_total, gram)
    try:
        if start is not None and not start[0]:  # no task reaches the trunk
            grads: tuple[Tensor | None, ...] | None = (None,) * len(inputs)
        else:
            grads = batched_grads(roots, inputs, passes, retain_graph=True, start=start)
        del start
        if grads is None or hooks.unbatched:
            return None, grads is not None
        hooks.finish()
    finally:
        hooks.remove()
    rest = list(grads[len(asked):])
    del grads
    _add_row_blocks(gram, rest, k_total)
    return gram, True
