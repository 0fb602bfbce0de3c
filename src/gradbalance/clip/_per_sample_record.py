"""The one record of a trunk's layer calls that GhostNorms and the per-sample Gramian read:
forward hooks keeping each call's input and output, and the checks that those calls are the
whole of each parameter's per-sample gradient, one error text each (docs/per_sample.md,
"Layers")."""

from __future__ import annotations

import warnings
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node, get_gradient_edge
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves

from .._graph import own_output, record_calls, tensor_hooked, uses_and_nodes, uses_below
from ._per_sample_layers import HookedLayer, batched_rank

__all__ = ["Fallback", "FallbackCall", "LayerRecorder"]


@dataclass(frozen=True)
class FallbackCall:
    """One recorded call of a fallback module: the leaves of its ``(args, kwargs)`` (tensors
    detached) and their structure, and the positions, among the leaves of its output, of the
    outputs that carry a gradient (recorded in :attr:`Fallback.outputs`, in order)."""

    leaves: list[Any]
    spec: TreeSpec
    carried: list[int]
    stops: frozenset[Node] = frozenset()  # the gradient edges of its tensor arguments

    @property
    def first(self) -> Tensor:
        """The first tensor argument (its dim 0 is the batch)."""
        return next(t for t in self.leaves if isinstance(t, Tensor))


class Fallback:
    """A module whose parameters (``names``, dotted below it) have no outer form: its recorded
    calls, their carried outputs in order, and the first call that had no tensor argument."""

    def __init__(self, name: str, module: nn.Module, names: list[str]) -> None:
        self.name = name
        self.module = module
        self.names = names
        self.inputs: list[FallbackCall] = []
        self.outputs: list[Tensor] = []
        self.bad_call: str | None = None

    def uses(self) -> dict[int, int]:
        """How many times the recorded calls use each of the module's parameters, by ``id``:
        the graph below each call's outputs, cut at its arguments."""
        params = [self.module.get_parameter(name) for name in self.names]
        total = dict.fromkeys(map(id, params), 0)
        at = 0
        for call in self.inputs:
            outputs = self.outputs[at: at + len(call.carried)]
            at += len(call.carried)
            found = uses_below([get_gradient_edge(y).node for y in outputs], call.stops, params)
            for key, n in found.items():
                total[key] += n
        return total


class LayerRecorder:
    """Forward hooks recording the calls of hooked layers and fallback modules under grad.

    ``owner`` names the user in messages; ``many_calls``: the advice of a warning when a layer
    holds 64 calls. ``sites``: each parameter's id to its (layer, is the weight) uses;
    ``dense``: to its fallback modules."""

    #: Recorded calls of one layer past which a forgotten clear is likely.
    MANY_CALLS = 64

    def __init__(self, owner: str, many_calls: str | None = None) -> None:
        self.owner = owner
        self.many_calls = many_calls
        self.layers: list[HookedLayer] = []
        self.fallbacks: list[Fallback] = []
        self.sites: dict[int, list[tuple[HookedLayer, bool]]] = {}
        self.dense: dict[int, list[tuple[Fallback, int]]] = {}
        self.names: dict[int, str] = {}
        self.recording = True
        self.reached: set[int] = set()  # ids of the parameters the last checked losses reach
        self._handles: list[Any] = []
        self._versions: dict[int, int] = {}  # each recorded output's version when recorded
        self._foreign: dict[int, str] = {}  # why a recorded output is not its layer's own

    def add_layer(self, name: str, module: nn.Module, wanted: Container[int]) -> HookedLayer:
        """Hook a covered layer for its weight and bias whose ids are ``wanted``."""
        bias = getattr(module, "bias", None)
        layer = HookedLayer(name, module, id(module.weight) in wanted,
                            bias is not None and id(bias) in wanted)
        self.layers.append(layer)
        for pname, p, is_weight in layer.bounded():
            self.names.setdefault(id(p), pname)
            self.sites.setdefault(id(p), []).append((layer, is_weight))
        own = [p for _, p, _ in layer.bounded()]
        self._handles.append(record_calls(module, self._record_layer(layer, own)))
        return layer

    def add_fallback(self, name: str, module: nn.Module,
                     own: Sequence[tuple[str, Tensor]]) -> None:
        """Hook a module whose parameters ``own`` (name below it, tensor) have no outer
        form."""
        fallback = Fallback(name, module, [pname for pname, _ in own])
        self.fallbacks.append(fallback)
        for index, (pname, p) in enumerate(own):
            self.names.setdefault(id(p), f"{name}.{pname}" if name else pname)
            self.dense.setdefault(id(p), []).append((fallback, index))
        self._handles.append(module.register_forward_hook(self._record_fallback(fallback),
                                                          with_kwargs=True))

    def _record_layer(self, layer: HookedLayer, own: list[Tensor]) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], output: Tensor,
                   hook_id: int) -> None:
            if self._live() and output.requires_grad:
                why = _foreign_call(layer, own, hook_id)
                if why is not None:
                    self._foreign[id(output)] = why
                self._keep(layer, args[0], output)
                if self.many_calls is not None and len(layer.outputs) == self.MANY_CALLS:
                    warnings.warn(f"{self.owner} holds {self.MANY_CALLS} forwards of layer "
                                  f"{layer.name!r} {self.many_calls}", RuntimeWarning,
                                  stacklevel=2)
        return record

    def _record_fallback(self, fallback: Fallback) -> Any:
        def record(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                   output: Any) -> None:
            if not self._live():
                return
            leaves, spec = tree_flatten((args, kwargs))
            if not any(isinstance(t, Tensor) for t in leaves):
                fallback.bad_call = (f"no tensor argument ({len(args)} positional and "
                                     f"{len(kwargs)} keyword)")
                return
            self._keep_call(fallback, leaves, spec, tree_leaves(output))
        return record

    def _keep_call(self, fallback: Fallback, leaves: list[Any], spec: TreeSpec,
                   outputs: list[Any]) -> None:
        """Record a fallback call whose outputs carry a gradient (the others are no use)."""
        carried = [i for i, y in enumerate(outputs) if isinstance(y, Tensor) and y.requires_grad]
        if not carried:
            return
        stops = frozenset(get_gradient_edge(t).node for t in leaves
                          if isinstance(t, Tensor) and t.requires_grad)
        fallback.inputs.append(FallbackCall(
            [t.detach() if isinstance(t, Tensor) else t for t in leaves], spec, carried, stops))
        for i in carried:
            fallback.outputs.append(outputs[i])
            self._versions[id(outputs[i])] = outputs[i]._version

    def _live(self) -> bool:
        """Whether a call now is one of the step's forward: recording, under grad, and not
        inside a backward (where a non-reentrant ``torch.utils.checkpoint`` recomputes the
        calls already recorded; their recorded outputs stay those on the losses' graph)."""
        return (self.recording and torch.is_grad_enabled()
                and torch._C._current_autograd_node() is None)

    def _keep(self, record: HookedLayer, x: Tensor, output: Tensor) -> None:
        record.inputs.append(x.detach())
        record.outputs.append(output)
        self._versions[id(output)] = output._version

    def records(self) -> list[HookedLayer | Fallback]:
        """Every hooked layer, then every fallback module."""
        return [*self.layers, *self.fallbacks]

    def check(self, losses: Tensor, params: list[Tensor], fix_batch: str, fix: str) -> None:
        """Refuse (``ValueError``/``RuntimeError``) a fallback call not one tensor in and out,
        inputs of another batch than ``losses``' (``fix_batch``), an output modified in place
        after its layer, a parameter of ``params`` with a tensor hook or used more often than
        recorded (``fix``: the user's alternative)."""
        for fallback in self.fallbacks:
            if fallback.bad_call is not None:
                raise ValueError(
                    f"layer {fallback.name!r} ({type(fallback.module).__name__}) was called "
                    f"with {fallback.bad_call}; the per-sample fallback needs the batch as "
                    f"dim 0 of a tensor argument: wrap it, or leave its parameters out of "
                    f"shared_params"
                )
        starts = [losses.grad_fn] if losses.grad_fn is not None else []
        # every recorded output is one use of what it reads: a fallback module whose output
        # is an op of its parameters alone (an nn.EmbeddingBag's lookup) is one call however
        # many nodes read that output
        ends = {y.grad_fn for record in self.records() for y in record.outputs
                if y.grad_fn is not None}
        uses, nodes = uses_and_nodes(starts, (), params, ends)
        self._drop_unreached(nodes)
        self._check_own(fix)
        self._check_batch(losses.shape[0], fix_batch)
        self._check_unchanged(fix)
        self._check_uses(uses, params, fix)

    def _drop_unreached(self, nodes: set[Node]) -> None:
        """Drop the recorded calls whose outputs are not on the losses' graph (``nodes``):
        a forward abandoned before its backward, or one under grad for another purpose,
        gives these losses nothing, as with plain ``backward``."""
        for layer in self.layers:
            kept = [i for i, y in enumerate(layer.outputs) if y.grad_fn in nodes]
            if len(kept) < len(layer.outputs):
                layer.inputs[:] = [layer.inputs[i] for i in kept]
                layer.outputs[:] = [layer.outputs[i] for i in kept]
        for fallback in self.fallbacks:
            calls, outputs, at = [], [], 0
            for call in fallback.inputs:
                mine = fallback.outputs[at: at + len(call.carried)]
                at += len(call.carried)
                if any(y.grad_fn in nodes for y in mine):
                    calls.append(call)
                    outputs += mine
            fallback.inputs[:], fallback.outputs[:] = calls, outputs

    def _check_own(self, fix: str) -> None:
        """Refuse a recorded call (on the losses' graph) that is not its layer's own."""
        for layer in self.layers:
            for y in layer.outputs:
                why = self._foreign.get(id(y))
                if why is not None:
                    raise RuntimeError(
                        f"{why}, so {self.owner} would miss part of its per-sample gradient. "
                        f"Call the layer with its own parameters and leave its output to it, "
                        f"or {fix}"
                    )

    def _check_batch(self, batch: int, fix: str) -> None:
        for record in self.records():
            firsts = [c.first if isinstance(c, FallbackCall) else c for c in record.inputs]
            rank = batched_rank(record.module) if isinstance(record, HookedLayer) else 1
            if any(t.dim() < rank or t.shape[0] != batch for t in firsts):
                shapes = [tuple(t.shape) for t in firsts]
                ranked = (f" (a batched input of {type(record.module).__name__} has at least "
                          f"{rank} dims)" if any(t.dim() < rank for t in firsts) else "")
                raise ValueError(
                    f"layer {record.name!r} recorded inputs of shapes {shapes} but the losses "
                    f"have {batch} samples: the batch must be dim 0 of every layer "
                    f"input{ranked}, and {fix}"
                )

    def _check_unchanged(self, fix: str) -> None:
        for record in self.records():
            for y in record.outputs:
                if y._version != self._versions.get(id(y), y._version):
                    raise ValueError(
                        f"the output of layer {record.name!r} ({type(record.module).__name__}) "
                        f"was modified in place after the layer (version "
                        f"{self._versions[id(y)]} -> {y._version}), so its gradient would be "
                        f"the in-place op's, not the layer's: use inplace=False there (e.g. "
                        f"nn.ReLU(inplace=False)), or {fix}"
                    )

    def _check_uses(self, uses: dict[int, int], params: list[Tensor], fix: str) -> None:
        self.reached = {id(p) for p in params if uses[id(p)] > 0}
        inside: dict[int, int] = {}  # the uses inside the fallback modules' recorded calls
        for fallback in self.fallbacks:
            for key, n in fallback.uses().items():
                inside[key] = inside.get(key, 0) + n
        for p in params:
            calls = sum(len(layer.outputs) for layer, _ in self.sites.get(id(p), []))
            calls += inside.get(id(p), 0)
            hooked = tensor_hooked(p)
            if hooked or uses[id(p)] > calls:
                how = ("has a tensor hook, which rewrites its gradient" if hooked else
                       f"is used {uses[id(p)]} times on the losses' graph but its layer(s) "
                       f"recorded {calls} calls")
                raise RuntimeError(
                    f"parameter {self.names[id(p)]!r} {how}, so {self.owner} misses part of "
                    f"its per-sample gradient. Call the layer itself wherever its weight is "
                    f"used (not F.linear(x, layer.weight)), run the forward after building "
                    f"{self.owner}, or {fix}"
                )

    def clear(self) -> None:
        """Drop the recorded calls."""
        for record in self.records():
            record.inputs.clear()
            record.outputs.clear()
        for fallback in self.fallbacks:
            fallback.bad_call = None
        self._versions.clear()
        self._foreign.clear()

    def remove(self) -> None:
        """Remove the hooks (and the records)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()


def _foreign_call(layer: HookedLayer, own: Sequence[Tensor], hook_id: int) -> str | None:
    """Why a call now is not the outer form of ``layer``'s parameters ``own`` (None: it is):
    a parameter swapped for the call (``torch.func.functional_call``, a weight a pre-hook
    computes), or a forward hook run before the record's (``hook_id``) that may have
    replaced the output."""
    current = [p for _, p, _ in layer.bounded()]
    if len(current) != len(own) or any(p is not q for p, q in zip(current, own)):
        return (f"layer {layer.name!r} ({type(layer.module).__name__}) was called with a "
                f"weight or bias that is not its parameter (torch.func.functional_call, a "
                f"weight computed by a forward pre-hook)")
    if not own_output(layer.module, hook_id):
        return (f"a forward hook of layer {layer.name!r} ({type(layer.module).__name__}) "
                f"runs before the record of its output and may replace it")
    return None
