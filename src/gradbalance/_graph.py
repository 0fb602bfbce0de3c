"""How a loss's graph uses given leaves, and their tensor hooks: what makes a route built from
recorded forwards exact (docs/loop.md, "One update whatever the route")."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

__all__ = ["edges", "leaf_uses", "own_output", "reached_around", "reaches", "record_calls",
           "tensor_hooked", "uses_and_nodes", "uses_below"]


def edges(*starts: Node | None, stops: Collection[Node] = ()) -> Iterator[tuple[Node, Node]]:
    """Every edge ``(parent, child)`` of the graph below ``starts`` (None: none), breadth
    first, not below a node of ``stops`` other than a start (an edge into a stop is
    yielded)."""
    queue = deque(dict.fromkeys(node for node in starts if node is not None))
    seen = set(queue)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            yield node, child
            if child not in seen and child not in stops:
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


def reached_around(tensor: Tensor, stop: Node | None,
                   params: Sequence[Tensor]) -> tuple[bool, int | None]:
    """``(met, i)``: whether ``tensor``'s graph reaches ``stop``, and the index in ``params``
    of the first one it reaches on a path that does not pass through ``stop`` (None: none).
    The walk does not go below ``stop``."""
    ids = {id(p): i for i, p in enumerate(params)}
    met, found = False, None
    for _, child in edges(tensor.grad_fn, stops=() if stop is None else (stop,)):
        met = met or child is stop
        leaf = _leaf_id(child)
        if found is None and leaf in ids:
            found = ids[leaf]
    return met, found


def leaf_uses(tensor: Tensor, leaves: Sequence[Tensor],
              ends: Collection[Node] = ()) -> dict[int, int]:
    """How many times ``tensor``'s graph uses each of ``leaves``, by ``id`` (:func:`uses_below`)."""
    return uses_below([tensor.grad_fn] if tensor.grad_fn is not None else [], (), leaves, ends)


def uses_below(starts: Sequence[Node], stops: Collection[Node],
               leaves: Sequence[Tensor], ends: Collection[Node] = ()) -> dict[int, int]:
    """How many times the graph below ``starts``, cut at ``stops`` (e.g. the gradient edges
    of a module call's inputs: then the uses inside the call), uses each of ``leaves``, by
    ``id``.

    A use is a node that reads the leaf with something else (two or more inputs), a node of
    ``ends`` (a recorded layer output's) or a start, reaching the leaf through nodes of one
    input each (a cast, a transpose, a view): so a cast autocast shares between calls counts
    each call, and a saved ``weight.t()`` a double backward reads again counts twice."""
    return uses_and_nodes(starts, stops, leaves, ends)[0]


def uses_and_nodes(starts: Sequence[Node], stops: Collection[Node], leaves: Sequence[Tensor],
                   ends: Collection[Node] = ()) -> tuple[dict[int, int], set[Node]]:
    """:func:`uses_below`, and the nodes of that graph (one walk for both)."""
    counts = dict.fromkeys(map(id, leaves), 0)
    starts = [node for node in starts if node not in stops]  # an argument returned as is
    fan_in: Counter[Node] = Counter(starts)
    parents: dict[Node, list[Node]] = {}  # of the nodes of one input, for the uses
    into_leaf: list[tuple[Node, int]] = []  # (the parent, the leaf's id) of every edge to a leaf
    for node, child in edges(*starts, stops=stops):
        if child in stops:  # an input of the cut: a leaf given as an argument is no use of it
            continue
        fan_in[child] += 1
        leaf = _leaf_id(child)
        if leaf in counts:
            into_leaf.append((node, leaf))
        elif _unary(child):
            parents.setdefault(child, []).append(node)
    uses = _Uses(parents, Counter(starts), ends)
    for parent, leaf in into_leaf:
        counts[leaf] += uses.of(parent)
    return counts, set(fan_in)


def _unary(node: Node) -> bool:
    """Whether ``node`` has one input (a cast, a transpose, a view, a product by a constant)."""
    return sum(child is not None for child, _ in node.next_functions) == 1


class _Uses:
    """The uses a node passes to the nodes below it: one where it reads several inputs, is
    an end or a start, else the sum of its parents' (iterative: chains may be long)."""

    def __init__(self, parents: dict[Node, list[Node]], starts: Counter[Node],
                 ends: Collection[Node]) -> None:
        self.parents, self.starts, self.ends = parents, starts, ends
        self.memo: dict[Node, int] = {}

    def _own(self, node: Node) -> int | None:
        """The node's uses where they do not depend on its parents' (None: they do)."""
        if node in self.ends or not _unary(node):
            return 1
        if node not in self.parents:
            return self.starts[node] or 1
        return None

    def of(self, node: Node) -> int:
        stack = [node]
        while stack:
            top = stack[-1]
            if top in self.memo:
                stack.pop()
                continue
            own = self._own(top)
            if own is not None:
                self.memo[top] = own
                stack.pop()
                continue
            waiting = [q for q in self.parents[top] if q not in self.memo]
            if waiting:
                stack.extend(waiting)
                continue
            self.memo[top] = self.starts[top] + sum(self.memo[q] for q in self.parents[top])
            stack.pop()
        return self.memo[node]


def tensor_hooked(param: Tensor) -> bool:
    """Whether ``param`` has a tensor hook (``param.register_hook``)."""
    hooks = getattr(param, "_backward_hooks", None)
    return bool(hooks)


#: The ids of the forward hooks :func:`record_calls` registered: they never replace an output.
_RECORDING: set[int] = set()


def record_calls(module: nn.Module, hook: Callable[..., None], *,
                 with_kwargs: bool = False) -> RemovableHandle:
    """Register ``hook(module, args, [kwargs,] output, hook_id)`` first among ``module``'s
    forward hooks, where it sees the output the module returned (:func:`own_output` says
    whether a hook registered later with ``prepend=True`` came before it)."""
    hook_id: list[int] = []

    def call(*args: Any) -> None:
        hook(*args, hook_id[0])

    handle = module.register_forward_hook(call, prepend=True, with_kwargs=with_kwargs)
    hook_id.append(handle.id)
    _RECORDING.add(handle.id)
    return handle


def own_output(module: nn.Module, hook_id: int) -> bool:
    """Whether the forward hook ``hook_id`` of ``module`` receives the module's own output:
    no global forward hook, and only recording hooks (:func:`record_calls`) before it."""
    if getattr(nn.modules.module, "_global_forward_hooks", None):
        return False
    for key in module._forward_hooks:
        if key == hook_id:
            return True
        if key not in _RECORDING:
            return False
    return False
