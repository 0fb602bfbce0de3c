"""How a loss's graph uses given leaves, and their tensor hooks: what makes a route built from
recorded forwards exact (docs/loop.md, "One update whatever the route")."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator, Sequence

from torch import Tensor
from torch.autograd.graph import Node

__all__ = ["edges", "leaf_uses", "reaches", "tensor_hooked"]

#: A node that only casts its one input (autocast shares one cast of a weight per region).
_CAST = "ToCopyBackward0"


def edges(start: Node | None) -> Iterator[tuple[Node, Node]]:
    """Every edge ``(parent, child)`` of the graph below ``start``, breadth first."""
    queue = deque([start] if start is not None else [])
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            yield node, child
            if child not in seen:
                seen.add(child)
                queue.append(child)


def _leaf_id(node: Node) -> int | None:
    """The ``id`` of the leaf an ``AccumulateGrad`` node accumulates into (None elsewhere)."""
    variable = getattr(node, "variable", None)
    return None if variable is None else id(variable)


def reaches(tensor: Tensor, params: Sequence[Tensor]) -> bool:
    """Whether one of ``params`` lies on ``tensor``'s graph (stops at the first found)."""
    ids = {id(p) for p in params}
    return any(_leaf_id(child) in ids for _, child in edges(tensor.grad_fn))


def leaf_uses(tensor: Tensor, leaves: Sequence[Tensor]) -> dict[int, int]:
    """How many times ``tensor``'s graph uses each of ``leaves``, by ``id`` (through casts)."""
    counts = dict.fromkeys(map(id, leaves), 0)
    fan_in: Counter[Node] = Counter([tensor.grad_fn] if tensor.grad_fn is not None else [])
    into_leaf: list[tuple[Node, int]] = []  # (the parent, the leaf's id) of every edge to a leaf
    for node, child in edges(tensor.grad_fn):
        fan_in[child] += 1
        leaf = _leaf_id(child)
        if leaf in counts:
            into_leaf.append((node, leaf))
    for parent, leaf in into_leaf:
        cast = type(parent).__name__ == _CAST and len(parent.next_functions) == 1
        counts[leaf] += fan_in[parent] if cast else 1
    return counts


def tensor_hooked(param: Tensor) -> bool:
    """Whether ``param`` has a tensor hook (``param.register_hook``)."""
    hooks = getattr(param, "_backward_hooks", None)
    return bool(hooks)
