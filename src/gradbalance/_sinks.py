"""Where the K task passes of :func:`gradbalance.taskgrads.run_passes` put their gradients; a
sink ``by_backward`` takes no ``inputs`` and reads ``.grad`` after ordinary backward passes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import ClassVar, Protocol

import torch
from torch import Tensor

from ._sparse import dense

__all__ = ["PassSink", "RowsSink", "StackSink", "task_stack"]


class ColumnLayout(Protocol):
    """The parameters and each one's column range in a row (``ParamLayout``, ``ShardedLayout``)."""

    @property
    def params(self) -> Sequence[Tensor]:
        """The parameters, in row order."""

    def slices(self) -> Iterable[tuple[Tensor, int, int]]:
        """``(param, start, stop)`` for each parameter, in order."""


class PassSink(Protocol):
    """What :func:`~gradbalance.taskgrads.run_passes` writes into."""

    #: The passes are ordinary ``backward`` calls, run as a loop (this module's docstring).
    by_backward: ClassVar[bool]

    @property
    def inputs(self) -> Sequence[Tensor]:
        """The tensors whose gradients the sink takes, in the order it takes them."""

    def write_pass(self, k: int, grads: Sequence[Tensor | None]) -> None:
        """Task ``k``'s gradients at ``inputs``."""

    def write_batched(self, grads: Sequence[Tensor | None]) -> None:
        """Every task's gradients at ``inputs``, ``[K, *x.shape]`` each."""


def _write_part(part: Tensor, g: Tensor | None, accumulate: bool) -> None:
    if g is None:
        if not accumulate:
            part.zero_()
    elif accumulate:
        part.add_(dense(g).reshape(part.shape))
    else:
        part.copy_(dense(g).reshape(part.shape))


def _mark_reached(reached: list[bool] | None, grads: Sequence[Tensor | None]) -> None:
    """``reached[i] = True`` where ``grads[i]`` exists (some task reaches parameter i)."""
    if reached is not None:
        for i, g in enumerate(grads):
            if g is not None:
                reached[i] = True


def _write_row(row: Tensor, grads: Sequence[Tensor | None], layout: ColumnLayout,
               accumulate: bool) -> None:
    if not accumulate and all(g is not None for g in grads):
        torch.cat([dense(g).reshape(-1) for g in grads if g is not None], out=row)
        return
    for g, (_, start, stop) in zip(grads, layout.slices()):
        _write_part(row[start:stop], g, accumulate)


class RowsSink:
    """The ``[K, P]`` rows of ``layout``'s parameters written (or added) into ``out``."""

    by_backward: ClassVar[bool] = False

    def __init__(self, layout: ColumnLayout, out: Tensor, accumulate: bool,
                 reached: list[bool] | None = None) -> None:
        self.layout, self.out, self.accumulate, self.reached = layout, out, accumulate, reached

    @property
    def inputs(self) -> Sequence[Tensor]:
        return self.layout.params

    def write_pass(self, k: int, grads: Sequence[Tensor | None]) -> None:
        _write_row(self.out[k], grads, self.layout, self.accumulate)
        _mark_reached(self.reached, grads)

    def write_batched(self, grads: Sequence[Tensor | None]) -> None:
        for g, (_, start, stop) in zip(grads, self.layout.slices()):
            _write_part(self.out[:, start:stop], g, self.accumulate)
        _mark_reached(self.reached, grads)


class StackSink:
    """The gradients at ``inputs`` as ``[K, *x.shape]`` stacks (None where none reaches it)."""

    by_backward: ClassVar[bool] = False

    def __init__(self, inputs: Sequence[Tensor], num_tasks: int) -> None:
        self.inputs = list(inputs)
        self.num_tasks = num_tasks
        self.stacks: list[Tensor | None] = [None] * len(self.inputs)

    def write_pass(self, k: int, grads: Sequence[Tensor | None]) -> None:
        for j, g in enumerate(grads):
            if g is None:
                continue
            stack = self.stacks[j]
            if stack is None:
                stack = self.stacks[j] = g.new_zeros((self.num_tasks, *g.shape))
            stack[k].copy_(g)

    def write_batched(self, grads: Sequence[Tensor | None]) -> None:
        self.stacks = list(grads)


def task_stack(grad: Tensor, num_tasks: int) -> Tensor | None:
    """The ``[K, *shape]`` tensor behind the gradient a tensor hook sees inside one batched
    pass (``is_grads_batched``, torch's vmap over the tasks), task first; None outside one (a
    loop pass) or where this torch's batched call hides it."""
    try:
        level = torch._C._vmapmode_increment_nesting()  # the batched call's level, plus one
        torch._C._vmapmode_decrement_nesting()
        if level < 2:
            return None
        stack: Tensor = torch._remove_batch_dim(
            grad, level - 1, num_tasks, 0)
    except (AttributeError, RuntimeError):  # another torch's batching: not inside this one
        return None
    return stack if stack.shape == (num_tasks, *grad.shape) else None
