"""Where ``gramian`` mode's contracted passes may start: the trunk's outputs, where they cut
every path from the losses to the shared parameters (docs/performance.md, "Modes").

From a cut ``C``, task k's gradient ``∂Lₖ/∂C`` needs only task k's head, so K small passes give
the ``[K, *C]`` stacks and the one batched call runs from ``C`` through the trunk alone; from the
losses it would also cross all K heads for every task (``K²`` head gradients, each of ``C``'s
size, summed). The cut must be exact: every path down to a shared parameter crosses it, no
cut tensor lies below another, and none has a tensor hook or was modified in place.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.autograd.graph import Node

from .._graph import edges, tensor_hooked

__all__ = ["trunk_cut"]


def _leaf(node: Node) -> int | None:
    variable = getattr(node, "variable", None)
    return None if variable is None else id(variable)


def _tops(loss: Tensor, keys: dict[tuple[Node, int], Tensor], params: Sequence[Tensor]
          ) -> list[Tensor] | None:
    """The cut tensors the walk down from ``loss`` meets first; None where it reaches one of
    ``params`` without crossing one, or another output of a cut tensor's node."""
    cut_nodes = {node for node, _ in keys}
    wanted = {id(p) for p in params}
    if loss.grad_fn is None or loss.grad_fn in cut_nodes:
        return None
    met: dict[int, Tensor] = {}
    stack, seen = [loss.grad_fn], {loss.grad_fn}
    while stack:
        for child, nr in stack.pop().next_functions:
            if child is None:
                continue
            if child in cut_nodes:
                y = keys.get((child, nr))
                if y is None:  # another output of the same node: not cut
                    return None
                met[id(y)] = y
            elif _leaf(child) in wanted:
                return None
            elif child not in seen:
                seen.add(child)
                stack.append(child)
    return list(met.values())


def _intact(outputs: Sequence[tuple[Tensor, int]]) -> bool:
    """Every recorded output is still on the graph, unedited since recorded and unhooked."""
    return all(y.grad_fn is not None and y._version == version and not tensor_hooked(y)
               for y, version in outputs)


def _one_below_another(tops: Sequence[Tensor], cut_nodes: set[object]) -> bool:
    """Whether a cut tensor lies right below another (its gradient would count twice)."""
    for top in tops:
        assert top.grad_fn is not None
        if any(child in cut_nodes for _, child in edges(top.grad_fn)):
            return True
    return False


def trunk_cut(loss: Tensor, outputs: Sequence[tuple[Tensor, int]], params: Sequence[Tensor]
              ) -> list[Tensor] | None:
    """The ``outputs`` (each with its version when recorded) the batched passes may start
    from: those on ``loss``'s graph, where they cut every path from ``loss`` to ``params``;
    None where they do not (the passes start at the losses)."""
    if not outputs or not _intact(outputs):
        return None
    keys = {(y.grad_fn, y.output_nr): y for y, _ in outputs if y.grad_fn is not None}
    tops = _tops(loss, keys, params)
    if not tops or _one_below_another(tops, {node for node, _ in keys}):
        return None
    return tops
