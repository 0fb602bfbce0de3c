"""Each linear layer's route in ``gramian`` mode, ``"rows"`` or ``"activations"``, in one place:
the cost model decides unless ``force`` sets it; an inexact activations route takes the rows."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor
from torch.autograd.graph import Node

from .._graph import leaf_uses, tensor_hooked
from ._blocks import Block

__all__ = ["CONTRACT_MIN_TASKS", "Force", "contract_by_default", "forced_route", "inexact",
           "keep_exact", "keeps", "layer_shapes", "plan_routes", "promote_routes"]

#: From this many tasks on, ``passes="auto"`` contracts the passes where that holds less (the
#: contracted route's one more backward through the trunk costs about 1/K of the K passes).
CONTRACT_MIN_TASKS = 32

#: A route forced on every layer of linear form, or by block name; None: the cost model.
Force = str | dict[str, str] | None


def forced_route(force: Force, block: Block) -> str | None:
    """The route ``force`` sets for ``block`` (None: the cost model decides)."""
    route = force.get(block.name) if isinstance(force, dict) else force
    if route not in (None, "rows", "activations"):
        raise ValueError(
            f"Invalid force: {route!r} for {block.name} (expected 'rows', 'activations' "
            f"or None)"
        )
    return route


def keeps(block: Block, n: int, force: Force, stepping: bool, num_tasks: int | None) -> bool:
    """Whether a forward of ``n`` rows must keep its input and output: not where the layer
    takes the rows for sure (docs/performance.md, the per-layer choice)."""
    forced = forced_route(force, block)
    if forced is not None:
        return forced == "activations"
    if stepping:
        return block.route == "activations"
    k = 2 if num_tasks is None else num_tasks  # K = 2 before the first step
    return block.costs(n + block.called_rows(), k, 1).route == "activations"


def plan_routes(blocks: Sequence[Block], force: Force, k_total: int) -> None:
    """Each linear block's route for the step, from its first micro-batch's calls."""
    for block in blocks:
        forced = forced_route(force, block)
        if forced is not None:
            block.route = forced
        elif not block.calls or any(call.output is None for call in block.calls):
            block.route = "rows"  # no call, or a call whose tensors were not kept
        else:
            block.route = block.costs(block.called_rows(), k_total, 1).route


def promote_routes(blocks: Sequence[Block], force: Force, k_total: int, micro: int) -> None:
    """An unforced activations-route layer whose rows have become cheaper moves to rows."""
    for block in blocks:
        if block.route != "activations" or forced_route(force, block) is not None:
            continue
        n = sum(x.shape[0] for x in block.inputs)
        if n and block.costs(n, k_total, micro).route == "rows":
            block.to_rows(k_total)


def layer_shapes(blocks: Sequence[Block]) -> tuple[tuple[int, int, int, bool, bool], ...]:
    """``(n, i, o, weight, bias)`` of every linear block called since the last backward."""
    shapes = [block.shape(block.called_rows()) for block in blocks if block.calls]
    return tuple((s.n, s.i, s.o, s.weight, s.bias) for s in shapes)


def inexact(blocks: Sequence[Block], loss: Tensor) -> list[Block]:
    """The ``blocks`` whose activations route would miss part of their gradient: a parameter
    hooked, or used outside the block's recorded calls, or a call that is not the linear form
    of the block's parameters (:meth:`Block.exact_call`)."""
    hooked = [block for block in blocks if _foreign(block)]
    rest = [block for block in blocks if all(block is not h for h in hooked)]
    if not rest:
        return hooked
    uses = leaf_uses(loss, [p for block in rest for p in block.params], _outputs(rest))
    return hooked + [block for block in rest
                     if any(uses[id(p)] != len(block.calls) for p in block.params)]


def _outputs(blocks: Sequence[Block]) -> set[Node]:
    """The nodes of the recorded calls' outputs: each one use of the layer's parameters."""
    return {call.output.grad_fn for block in blocks for call in block.calls
            if call.output is not None and call.output.grad_fn is not None}


def _foreign(block: Block) -> bool:
    """Whether a parameter of ``block`` has a tensor hook, or a recorded call is not the
    layer's own (:meth:`Block.exact_call`)."""
    return any(map(tensor_hooked, block.params)) or not all(call.exact for call in block.calls)


def keep_exact(blocks: Sequence[Block], force: Force, loss: Tensor, k_total: int,
               first: bool) -> None:
    """Move every :func:`inexact` activations-route block to the rows; raise where forced."""
    active = [block for block in blocks if block.route == "activations"]
    for block in inexact(active, loss) if active else []:
        if forced_route(force, block) is not None:
            raise RuntimeError(
                f"mode='gramian': layer {block.name} is forced onto the activations route, "
                f"but a parameter of it has a tensor hook or is used outside its forward "
                f"(tied to another layer); its gradient needs the rows: force 'rows' there "
                f"or leave its route to the cost model"
            )
        if first:
            block.route = "rows"
        else:
            block.to_rows(k_total)


def _held(block: Block, k_total: int) -> int:
    """The elements the K passes keep of ``block`` on its route (its rows, or the output
    gradients of its calls)."""
    if block.route == "activations":
        assert block.form is not None
        return k_total * block.called_rows() * block.form[1]
    return k_total * block.layout.numel


def contract_by_default(blocks: Sequence[Block], k_total: int) -> bool:
    """Whether ``passes="auto"`` contracts a step's passes (routes planned): at least
    :data:`CONTRACT_MIN_TASKS` tasks, and the operands the loop would keep of the layers with
    their calls kept, every layer's at once, outweigh what the contracted passes hold in
    their place: ``[K, K]``, the trunk's output gradients and one layer's (each counted as
    the largest). Other blocks give their rows either way (docs/performance.md, "Modes")."""
    if k_total < CONTRACT_MIN_TASKS:
        return False
    recorded = [_held(b, k_total) for b in blocks if b.linear and b.calls
                and all(call.output is not None for call in b.calls)]
    return bool(recorded) and sum(recorded) > k_total * k_total + 2 * max(recorded)
