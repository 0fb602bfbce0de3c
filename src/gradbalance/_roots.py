"""Where each task's backward pass starts: at its own loss, the scalar given or the stack's
input edge (docs/performance.md, "The task passes start at each task's own loss")."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node

from ._checks import LOSSES_WITHOUT_GRAD
from ._recompute import new_graph

__all__ = ["TaskRoots"]

#: Elementwise ops ``[K] -> [K]`` that may sit between the stack and the vector given.
_ELEMENTWISE = frozenset({
    "MulBackward0", "DivBackward0", "AddBackward0", "SubBackward0", "NegBackward0",
    "ToCopyBackward0",
})


def _chain_end(vector: Tensor) -> Node | None:
    """The node the elementwise ops back from ``vector`` lead to (each with one differentiable
    input); None where another op sits in between."""
    node = vector.grad_fn
    while node is not None and node.name() in _ELEMENTWISE:
        live = [child for child, _ in node.next_functions if child is not None]
        if len(live) != 1:
            return None
        node = live[0]
    return node


def _stack_edges(node: Node | None, k: int) -> list[GradientEdge] | None:
    """The ``k`` input edges of a ``torch.stack`` node (None otherwise, or for leaves)."""
    if node is None or node.name() != "StackBackward0" or len(node.next_functions) != k:
        return None
    edges = []
    for child, nr in node.next_functions:
        if child is None or child.name() == "torch::autograd::AccumulateGrad":
            return None
        edges.append(GradientEdge(child, nr))
    return edges


def _stack_inputs(vector: Tensor) -> tuple[list[GradientEdge], Tensor] | None:
    """The input edges of the ``torch.stack`` ``vector`` is made from and ``∂vₖ/∂cₖ``, or None;
    the factor is one backward to the stack's output, so hooks on the way run once and act on
    it, as in ``vector.sum().backward()``. Only for a loss vector ``[K]``: per-sample losses
    ``[B, K]`` stacked along the tasks have ``K`` stack inputs too, and with ``B = K`` they
    were taken for tasks."""
    if vector.dim() != 1:
        return None
    k = vector.shape[0]
    stack = _chain_end(vector)
    edges = _stack_edges(stack, k)
    if edges is None or stack is None:
        return None
    ones = torch.ones(k, dtype=vector.dtype, device=vector.device)
    if stack is vector.grad_fn and not getattr(vector, "_backward_hooks", None):
        return edges, ones
    (factor,) = torch.autograd.grad(vector, GradientEdge(stack, 0), grad_outputs=ones,
                                    retain_graph=True)
    return None if factor.shape != ones.shape else (edges, factor.detach())


class TaskRoots:
    """Where each task's backward pass starts, and the output gradient it starts with.

    Args:
        given: the losses as the user passed them (a list of scalars or a ``[K]`` tensor).
        vector: the same losses as one ``[K]`` tensor (:func:`~gradbalance._checks.as_loss_vector`).
        scale: the loss scale ``s`` (0-d), or None.
        past_the_stack: start at the stack's input edges where found. False on an FSDP2
            trunk: its hook on the root module's output (which may be the stack) must run in
            every pass, to gather the parameters.

    ``scaled`` is ``s·vector``; ``outputs[k]`` reaches task k's graph only (None: ``scaled[k]``
    is backpropagated); ``graph`` a number unique to these roots (their micro-batch's graph).
    """

    def __init__(self, given: Tensor | Sequence[Tensor], vector: Tensor,
                 scale: Tensor | None, past_the_stack: bool = True) -> None:
        if not vector.requires_grad:
            raise ValueError(LOSSES_WITHOUT_GRAD)
        self.scaled = vector if scale is None else vector * scale.to(vector.dtype)
        self.num_tasks = vector.shape[0]
        self.graph = new_graph()  # this micro-batch's graph, the recomputation guard's key
        self.outputs: list[Tensor | GradientEdge | None] | None = None
        factor: Tensor | None = None
        if isinstance(given, (list, tuple)):
            self.outputs = [t.reshape(()) if t.requires_grad else None for t in given]
        elif past_the_stack:
            found = _stack_inputs(vector)
            if found is not None:
                edges, factor = found
                self.outputs = list(edges)
        if factor is None:
            factor = torch.ones(self.num_tasks, dtype=vector.dtype, device=vector.device)
        factor = factor.to(vector.dtype)  # a float16 factor times the scale could overflow
        self.grad_outputs = factor if scale is None else factor * scale.to(vector.dtype)

    def grad(self, k: int, inputs: Sequence[Tensor], retain_graph: bool
             ) -> tuple[Tensor | None, ...]:
        """``∂(s·Lₖ)/∂x`` for every ``x`` in ``inputs`` (None where ``Lₖ`` does not reach it)."""
        if self.outputs is None:
            return torch.autograd.grad(self.scaled[k], inputs, retain_graph=retain_graph,
                                       allow_unused=True)
        root = self.outputs[k]
        if root is None:  # a constant loss: no gradient anywhere
            return (None,) * len(inputs)
        return torch.autograd.grad(root, inputs, grad_outputs=[self.grad_outputs[k]],
                                   retain_graph=retain_graph, allow_unused=True)

    def backward(self, k: int, retain_graph: bool) -> None:
        """An ordinary ``backward`` of ``s·Lₖ`` from the same root (into ``.grad``)."""
        if self.outputs is None:
            torch.autograd.backward(self.scaled[k], retain_graph=retain_graph)
            return
        root = self.outputs[k]
        if root is not None:
            torch.autograd.backward(root, grad_tensors=self.grad_outputs[k].reshape(()),
                                    retain_graph=retain_graph)
