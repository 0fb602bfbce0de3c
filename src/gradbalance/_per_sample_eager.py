"""Each layer's output gradients taken inside the backward, by a tensor hook, so that a layer
is contracted as soon as they arrive and they are then freed (docs/per_sample.md, "Layers").

``autograd.grad`` is asked only for the recorded outputs below which no other recorded output
lies (:func:`lowest`): the backward still runs through every other one, whose hook hands its
gradient over and keeps nothing, so the peak holds one layer's output gradients and
per-sample work rather than every layer's at once. A micro-batch's records kept for a later
pass (:class:`Recorded`) hold each output's gradient edge, not its storage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.autograd.graph import Node, get_gradient_edge

__all__ = ["Recorded", "Slots", "Snapshot", "edge_of", "lowest"]


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def lowest(roots: Sequence[Tensor], outputs: Sequence[Tensor]) -> list[bool]:
    """For each of ``outputs``: whether no other of them lies below it on the graph of
    ``roots`` (those must be asked of ``autograd.grad``; the backward reaches the others on
    its way to them). An output off the graph counts as lowest."""
    marked = {y.grad_fn for y in outputs}
    below: dict[Node, bool] = {}
    stack = [y.grad_fn for y in roots if y.grad_fn is not None]
    while stack:
        node = stack[-1]
        if node in below:
            stack.pop()
            continue
        waiting = [c for c in _children(node) if c not in below]
        if waiting:
            stack.extend(waiting)
            continue
        stack.pop()
        below[node] = any(c in marked or below[c] for c in _children(node))
    return [not below.get(y.grad_fn, False) for y in outputs]  # type: ignore[arg-type]


class Slots:
    """One layer's output gradients ``[task][call]`` as the hooks hand them over; ``done``
    runs once every one of them has arrived."""

    def __init__(self, tasks: int, calls: int, done: Callable[[list[list[Tensor | None]]], None]
                 ) -> None:
        self.grads: list[list[Tensor | None]] = [[None] * calls for _ in range(tasks)]
        self.missing = tasks * calls
        self.done = done
        self.task = 0

    def hook(self, call: int) -> Callable[[Tensor], None]:
        def take(grad: Tensor) -> None:
            row = self.grads[self.task]
            self.missing -= row[call] is None  # a hook fires once per pass
            row[call] = grad
            if self.missing == 0:
                self.finish()
        return take

    def finish(self) -> None:
        """Hand the gradients over (None: the output is off this task's graph) and drop
        them; later calls do nothing."""
        if self.missing >= 0:
            grads, self.grads, self.missing = self.grads, [], -1
            self.done(grads)


class Recorded:
    """A recorded output kept as its gradient edge and its shape (not its storage)."""

    def __init__(self, y: Tensor) -> None:
        self.edge = get_gradient_edge(y)
        self.shape, self.dtype, self.device = y.shape, y.dtype, y.device


Snapshot = list[tuple[list[Any], list[Recorded]]]  # inputs (tensors or fallback calls), outputs


def edge_of(y: Tensor | Recorded) -> Any:
    """What ``autograd.grad`` takes for a recorded output: the tensor, or its edge."""
    return y.edge if isinstance(y, Recorded) else y
