"""Parameter coverage: every trainable leaf the losses reach is balanced, a head's, or refused;
a reentrant checkpoint is refused, swapped lists warn (docs/loop.md, "Parameter coverage")."""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ._graph import edges
from ._roots import _stack_inputs

__all__ = [
    "Coverage",
    "OtherParams",
    "PlainGrads",
    "check_other_params",
    "fire_post_accumulate_hooks",
    "in_param_layout",
    "swap_warning",
    "walk_leaves",
]

OtherParams = Literal["raise", "sum", "ignore"]

#: The backward node of ``torch.utils.checkpoint(..., use_reentrant=True)``.
_REENTRANT = "CheckpointFunctionBackward"


def check_other_params(value: object) -> OtherParams:
    """``other_params`` is ``"raise"``, ``"sum"`` or ``"ignore"``."""
    if value in ("raise", "sum", "ignore"):
        return value
    raise ValueError(
        f"other_params must be 'raise', 'sum' or 'ignore', got {value!r}; 'sum' gives "
        f"trainable leaves in neither list their plain gradient of sum(losses), 'ignore' "
        f"leaves their .grad to the caller"
    )


def _accumulate_grad_type() -> type:
    """The class of autograd's ``AccumulateGrad`` nodes (the graph's trainable leaves)."""
    leaf = torch.zeros(1, requires_grad=True)
    node = (leaf * 1).grad_fn
    assert node is not None
    return type(node.next_functions[0][0])


_ACCUMULATE = _accumulate_grad_type()


def walk_leaves(start: Any) -> tuple[dict[int, tuple[Tensor, Any]], bool]:
    """The trainable leaves below the autograd node ``start`` (by id, with a node reading
    each); whether a reentrant checkpoint lies on the graph."""
    leaves: dict[int, tuple[Tensor, Any]] = {}
    reentrant = type(start).__name__ == _REENTRANT
    for node, child in edges(start):
        if type(child) is _ACCUMULATE:
            variable = child.variable  # type: ignore[attr-defined]  # AccumulateGrad
            leaves.setdefault(id(variable), (variable, node))
        elif type(child).__name__ == _REENTRANT:
            reentrant = True
    return leaves, reentrant


def _module_names(modules: Any) -> dict[int, str]:
    """Parameter id -> dotted name, from the module(s) given (empty when none)."""
    if isinstance(modules, nn.Module):
        modules = [modules]
    if not isinstance(modules, (list, tuple, nn.ModuleList)):
        return {}
    names: dict[int, str] = {}
    for m in modules:
        if isinstance(m, nn.Module):
            for name, p in m.named_parameters():
                names.setdefault(id(p), name)
    return names


def _task_reach(vector: Tensor) -> list[dict[int, tuple[Tensor, Any]]] | None:
    """The trainable leaves each task's loss reaches; None when the tasks' graphs are one."""
    found = _stack_inputs(vector)
    if found is None:
        return None
    return [walk_leaves(edge.node)[0] for edge in found[0]]


def _named(leaf: Tensor, names: dict[int, str]) -> str:
    name = names.get(id(leaf))
    return f"'{name}'" if name is not None else f"a tensor of shape {tuple(leaf.shape)}"


def _swapped_pair(counts: Counter[int], shared: set[int], heads: set[int],
                  tasks: int) -> tuple[int, int] | None:
    """A shared leaf reached by one task and a head leaf reached by all, or None."""
    reached_shared = [i for i in counts if i in shared]
    everywhere = [i for i in counts if i in heads and counts[i] == tasks]
    if not reached_shared or not everywhere or any(counts[i] > 1 for i in reached_shared):
        return None
    return reached_shared[0], everywhere[0]


def swap_warning(vector: Tensor, shared: set[int], heads: set[int],
                 names: dict[int, str]) -> str | None:
    """The warning when every reached shared parameter has one task and a head all of them."""
    reach = _task_reach(vector) if vector.shape[0] >= 2 else None
    if reach is None:
        return None
    pair = _swapped_pair(Counter(i for task in reach for i in task), shared, heads, len(reach))
    if pair is None:
        return None
    leaves = {i: leaf for task in reach for i, (leaf, _) in task.items()}
    return (
        f"shared_params and head_params look swapped: every shared parameter the losses "
        f"reach is reached by one task's loss only (e.g. {_named(leaves[pair[0]], names)}"
        f"), while head parameter {_named(leaves[pair[1]], names)} is reached by all {len(reach)} "
        f"tasks' losses. shared_params are the trunk's parameters, which every task uses "
        f"(balanced); head_params each task's own (plain gradient): pass "
        f"TaskGradBuffer(trunk.parameters(), head_params=heads.parameters())"
    )


class Coverage:
    """The coverage check of one buffer; it decides again when the leaves reached change."""

    def __init__(self, shared: Sequence[Tensor], heads: Sequence[Tensor],
                 other_params: OtherParams, modules: Any = None,
                 sum_offered: bool = True) -> None:
        self.shared, self.heads = list(shared), list(heads)
        self.other_params = other_params
        self.modules = modules
        self.sum_offered = sum_offered  # other_params='sum' exists on this route (not batch_dim)
        self._index()

    def _index(self) -> None:
        """The id-keyed look-ups, rebuilt after a pickle or a copy (ids do not survive it)."""
        self.known = {id(p) for p in self.shared} | {id(p) for p in self.heads}
        self.shared_ids = {id(p) for p in self.shared}
        self.names = _module_names(self.modules)
        self._reached: frozenset[int] | None = None  # the leaf ids of the last decision
        self._warned = False  # the swap warning, once per buffer
        self.others: list[Tensor] = []  # reached leaves in neither list ("sum")
        self.shared_reached: set[int] = set()  # this step's, for the post-accumulate hooks

    def __getstate__(self) -> dict[str, Any]:
        return {"shared": self.shared, "heads": self.heads, "other_params": self.other_params,
                "modules": self.modules, "sum_offered": self.sum_offered}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({"sum_offered": True, **state})  # a pickle from before the flag
        self._index()

    def check(self, vector: Tensor) -> list[Tensor]:
        """Raise on a reentrant checkpoint or an uncovered leaf; the leaves of ``"sum"``."""
        leaves, reentrant = walk_leaves(vector.grad_fn)
        if reentrant:
            raise ValueError(
                "the losses' graph holds torch.utils.checkpoint(..., use_reentrant=True), whose "
                "backward writes .grad directly, beside the balanced step (the trunk would get "
                "no balanced gradient); pass use_reentrant=False to torch.utils.checkpoint"
            )
        reached = frozenset(leaves)
        if reached != self._reached:
            others = [(p, op) for i, (p, op) in leaves.items() if i not in self.known]
            if others and self.other_params == "raise":
                raise ValueError(self._message(others))
            self.others = [p for p, _ in others] if self.other_params == "sum" else []
            self._reached = reached
            self._warn_swapped(vector)
        self.shared_reached |= reached & self.shared_ids
        return self.others

    def _warn_swapped(self, vector: Tensor) -> None:
        """Warn once if the two lists look swapped (:func:`swap_warning`)."""
        if self._warned or not self.heads:
            return
        heads = self.known - self.shared_ids
        message = swap_warning(vector, self.shared_ids, heads, self.names)
        if message is not None:
            self._warned = True
            warnings.warn(message, UserWarning, stacklevel=6)

    def _message(self, others: list[tuple[Tensor, Any]]) -> str:
        shown = []
        for p, node in others[:5]:
            name = self.names.get(id(p))
            where = f"'{name}'" if name is not None else "a tensor"
            shown.append(f"{where} (shape {tuple(p.shape)}, read by {node.name()})")
        more = f" and {len(others) - 5} more" if len(others) > 5 else ""
        plain = ("other_params='sum' gives such parameters their plain gradient of sum(losses)"
                 if self.sum_offered else "with batch_dim=0 head_params is the way to their "
                 "plain gradient of sum(losses) (an input that requires grad too)")
        return (
            f"{len(others)} trainable parameter(s) reached by the losses are in neither "
            f"shared_params nor head_params: {', '.join(shown)}{more}; they would get no "
            f"gradient. Add each to shared_params (balanced) or head_params (plain gradient), "
            f"or set requires_grad=False; a parameter unfrozen after the TaskGradBuffer was "
            f"built needs a new buffer that lists it; {plain}"
        )

    def end_step(self) -> None:
        """The step is over: the next one collects its own reached trunk parameters."""
        self.shared_reached = set()


def hooked_after_accumulation(params: Iterable[Tensor]) -> list[Tensor]:
    """The parameters of ``params`` with post-accumulate-grad hooks."""
    return [p for p in params if getattr(p, "_post_accumulate_grad_hooks", None)]


def fire_post_accumulate_hooks(params: Iterable[Tensor], reached: set[int]) -> None:
    """Run the post-accumulate-grad hooks of the ``reached`` parameters the step wrote."""
    for p in params:
        hooks = getattr(p, "_post_accumulate_grad_hooks", None)
        if hooks and id(p) in reached and p.grad is not None:
            for hook in tuple(hooks.values()):
                hook(p)


def in_param_layout(param: Tensor, grad: Tensor) -> Tensor:
    """``grad`` (``param``'s shape) with the strides autograd gives a new ``.grad``: the
    parameter's where it is dense and non-overlapping (a channels-last or transposed weight,
    ``torch.empty_like``'s rule), else contiguous; a copy only where they differ."""
    if (param.is_contiguous() and grad.is_contiguous()) or param.stride() == grad.stride():
        return grad  # the usual case: no allocation
    like = torch.empty_like(param, dtype=grad.dtype, device=grad.device)
    return grad if like.stride() == grad.stride() else like.copy_(grad)


class PlainGrads:
    """The plain gradients ``∂total/∂p`` of some leaves (the heads; the leaves
    ``other_params="sum"`` takes), computed before the step's task passes (the graph kept; a
    leaf's ``register_hook`` hooks run here, once, as in a plain backward) and accumulated
    into their ``.grad`` after them (:meth:`accumulate_`), where their
    ``register_post_accumulate_grad_hook`` hooks then run: a hook that steps its leaf in place
    (optimizer-in-backward) would otherwise change a weight the task passes still read
    (torch's in-place error, after the leaves had moved)."""

    def __init__(self, total: Tensor, params: Sequence[Tensor]) -> None:
        leaves = list(params)
        grads = (torch.autograd.grad(total, leaves, retain_graph=True, allow_unused=True)
                 if leaves else ())
        self.pairs = [(p, g) for p, g in zip(leaves, grads, strict=True) if g is not None]

    def accumulate_(self) -> None:
        """``.grad += g`` for every leaf reached, as autograd accumulates (a new ``.grad`` in
        the parameter's layout, a sparse one summed out of place), then the leaves'
        post-accumulate-grad hooks."""
        pairs, self.pairs = self.pairs, []
        with torch.no_grad():
            for p, g in pairs:
                if p.grad is None:
                    p.grad = g if g.layout != torch.strided else in_param_layout(p, g)
                elif p.grad.layout != torch.strided:  # sparse: summed out of place
                    p.grad = p.grad + g
                else:
                    p.grad.add_(g)
        fire_post_accumulate_hooks([p for p, _ in pairs], {id(p) for p, _ in pairs})
