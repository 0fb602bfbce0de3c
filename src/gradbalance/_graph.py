"""How a loss's graph uses given leaves (each one's count of uses) and tensor hooks: a route
that forms a gradient from its layer's recorded forwards (``gramian`` mode's activations,
:class:`~gradbalance.clip.GhostNorms`) is exact only where those are the only uses and no
hook rewrites it (docs/loop.md, "One update whatever the route").
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

from torch import Tensor
from torch.autograd.graph import Node

__all__ = ["leaf_uses", "tensor_hooked"]

#: A node that only casts its one input (autocast caches one cast of a weight per region,
#: shared by every use of it there).
_CAST = "ToCopyBackward0"


def _is_cast(node: Node) -> bool:
    return type(node).__name__ == _CAST and len(node.next_functions) == 1


def leaf_uses(tensor: Tensor, leaves: Sequence[Tensor]) -> dict[int, int]:
    """How many times ``tensor``'s graph uses each of ``leaves``, by ``id`` (an edge from a
    cast counts as the edges into that cast; one breadth-first walk)."""
    counts = dict.fromkeys(map(id, leaves), 0)
    start = tensor.grad_fn
    queue = deque([start] if start is not None else [])
    seen = set(queue)
    fan_in: Counter[Node] = Counter(queue)  # the root: one use
    into_leaf: list[tuple[Node, int]] = []  # (the parent, the leaf's id) of every edge to a leaf
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            fan_in[child] += 1
            variable = getattr(child, "variable", None)
            if variable is not None and id(variable) in counts:
                into_leaf.append((node, id(variable)))
            if child not in seen:
                seen.add(child)
                queue.append(child)
    for parent, leaf in into_leaf:
        counts[leaf] += fan_in[parent] if _is_cast(parent) else 1
    return counts


def tensor_hooked(param: Tensor) -> bool:
    """Whether ``param`` has a tensor hook (``param.register_hook``)."""
    hooks = getattr(param, "_backward_hooks", None)
    return bool(hooks)
