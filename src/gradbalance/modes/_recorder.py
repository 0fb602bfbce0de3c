"""``gramian`` mode's recorder: forward hooks, the K passes into each block's operands, the
Gramian and the weighted write-back."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._checks import module_list
from .._graph import reaches, record_calls, tensor_hooked
from .._sinks import PassSink, RowsSink, StackSink
from ..balancers._base import combine_rows
from ..distributed import all_gather_columns, all_ranks_true, all_reduce_mean_
from ..gramian import compute_gramian, linear_gramian
from ..taskgrads import Concrete, Passes, TaskRoots, run_passes
from ._blocks import Block, Call, find_blocks
from ._contracted import ContractedStep, contract_passes
from ._cut import trunk_cut
from ._engine import WriteBack
from ._layers import rows_grad, rows_input
from ._routes import (
    CONTRACT_MIN_TASKS,
    Force,
    contract_by_default,
    inexact,
    keep_exact,
    keeps,
    plan_routes,
    promote_routes,
)

__all__ = ["GramianRecorder"]

#: Recorded forwards of one layer past which a forgotten torch.no_grad() is likely.
_MANY_CALLS = 64

_COMPILED = (
    "mode='gramian' cannot record a torch.compile'd trunk: the compiled graph hides the "
    "layer inputs and output gradients its Gramian is built from. Use mode='matrix' with a "
    "compiled trunk, or leave the trunk uncompiled (docs/integrations.md, torch.compile)"
)


def _roots_of(modules: nn.Module | Iterable[nn.Module]) -> list[nn.Module]:
    roots = module_list(modules)
    if any(hasattr(m, "_orig_mod") for m in roots):  # torch.compile's OptimizedModule
        raise RuntimeError(_COMPILED)
    return roots


def _recorded_input(block: Block, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    x = args[0] if args else kwargs.get("input")
    if not isinstance(x, Tensor):
        raise RuntimeError(
            f"mode='gramian': module {block.name} ({type(block.module).__name__}) was "
            f"called without an input tensor it can record (found {type(x).__name__}); "
            f"call it as layer(x)"
        )
    return x


def _check_called(block: Block, roots: TaskRoots) -> bool:
    """Whether ``block`` has recorded calls; raise if it has none yet the losses depend on it."""
    if block.calls:
        return True
    if not reaches(roots.scaled, block.params):
        return False
    raise RuntimeError(
        f"mode='gramian': module {block.name} ({type(block.module).__name__}) was "
        f"not called as a module during the forward under grad, yet the losses "
        f"depend on its parameters; run the forward (with the buffer built "
        f"before it) before backward(), or use mode='matrix' if the parameters are "
        f"used another way"
    )


def _kept_outputs(block: Block) -> list[Tensor]:
    """The outputs ``block``'s calls kept, checked for in-place edits since their forward."""
    check_unedited(block)
    return [call.output for call in block.calls
            if call.input is not None and call.output is not None]


def check_unedited(block: Block) -> None:
    """Raises where an input or output ``block``'s calls kept was modified in place after
    its forward (the activations route would read it)."""
    for call in block.calls:
        if call.input is not None and call.output is not None and not _unchanged(call):
            raise RuntimeError(
                f"mode='gramian': the output or input of module {block.name} was "
                f"modified in place after its forward (e.g. nn.ReLU(inplace=True)); "
                f"use out-of-place ops in the trunk or mode='matrix'"
            )


def _unchanged(call: Call) -> bool:
    """Whether the call's input and output are as its forward left them."""
    assert call.input is not None and call.output is not None
    return (call.input._version, call.output._version) == call.versions


class GramianRecorder:
    """Forward hooks on the trunk's linear blocks; the Gramian and the weighted write-back."""

    def __init__(self, modules: nn.Module | Iterable[nn.Module], params: Sequence[Tensor]) -> None:
        roots = _roots_of(modules)
        self.blocks = find_blocks(roots, params)
        self.params = list(params)
        self.device = params[0].device  # where the passes run, as in matrix mode
        self.linear = [block for block in self.blocks if block.linear]
        self.other = [block for block in self.blocks if not block.linear]
        self.force: Force = None  # a route forced on every layer, or by block name
        self.num_tasks: int | None = None  # the last step's K (keeps() reads it)
        self._stepping = False  # a micro-batch of the current step has run its passes
        # batched passes may contract each layer inside the backward (the mode's passes say
        # so), unless a step needed the operands (micro-batches, ranks): then it keeps them
        self.contract = False
        self.by_name = False  # batched passes asked for by name: contracted whatever the K
        self.keep_operands = False
        self.contracted: ContractedStep | None = None  # this step's, until apply or clear
        self.tops: list[tuple[Tensor, int]] = []  # the trunk's outputs, each with its version
        ref = weakref.ref(self)
        # first among each layer's forward hooks: the output the layer itself returned
        self._handles = [_hook_layer(ref, block) for block in self.linear]
        self._handles += [root.register_forward_hook(_make_top_hook(ref)) for root in roots]

    def record(self, block: Block, args: tuple[Any, ...], kwargs: dict[str, Any],
               output: Any, hook_id: int) -> None:
        if not (torch.is_grad_enabled() and isinstance(output, Tensor) and output.requires_grad):
            return
        if torch._C._current_autograd_node() is not None:
            return  # a non-reentrant checkpoint recomputing, inside a backward, a recorded call
        if "Compiled" in type(output.grad_fn).__name__:  # an output of a compiled graph
            raise RuntimeError(_COMPILED)
        x = _recorded_input(block, args, kwargs)
        assert block.form is not None
        n = output.numel() // max(block.form[1], 1)
        loop = keeps(block, n, self.force, self._stepping, self.num_tasks)
        exact = block.exact_call(hook_id)
        if loop or self._may_contract():
            block.calls.append(Call(n, x, output, (x._version, output._version), loop, exact))
        else:
            block.calls.append(Call(n, exact=exact))
        if len(block.calls) == _MANY_CALLS:
            warnings.warn(
                f"mode='gramian' holds {_MANY_CALLS} forwards of layer {block.name!r} since "
                f"the last backward(): every forward under grad is kept until the next "
                f"backward() or reset(); evaluate under torch.no_grad()",
                RuntimeWarning, stacklevel=2)

    def _may_contract(self) -> bool:
        """Whether the step's first micro-batch may be contracted: every call is kept (by
        ``auto``'s rule, from the last step's K on)."""
        if not self.contract or self.keep_operands or self._stepping:
            return False
        return self.by_name or self.num_tasks is None or self.num_tasks >= CONTRACT_MIN_TASKS

    def clear(self) -> None:
        """Forget the step: recorded calls, output gradients, inputs and rows."""
        self._stepping = False
        self.contracted = None
        self.tops.clear()
        for block in self.blocks:
            block.forget()

    def check_later_micro_batch(self) -> None:
        """Raises before a later micro-batch's passes where the activations route would read
        an output modified in place (:func:`check_unedited`): refused as a check, the step's
        earlier micro-batches kept, not dropped by a failure inside the passes. The refused
        forward's calls are forgotten (its outputs stay edited): the micro-batch's forward runs
        again."""
        try:
            for block in self.linear:
                if block.route == "activations":
                    check_unedited(block)
        except RuntimeError as error:
            for block in self.linear:
                block.calls.clear()
            raise RuntimeError(
                f"{error}; the step's earlier micro-batches are kept and this one's forward "
                f"is forgotten: run it again") from None

    def _check_recorded(self, roots: TaskRoots, every: bool = False) -> list[Tensor]:
        """The recorded outputs of the activations-route (``every``: all linear) layers."""
        outputs: list[Tensor] = []
        for block in self.linear:
            if (block.route == "activations" or every) and _check_called(block, roots):
                outputs += _kept_outputs(block)
        return outputs

    @property
    def routes(self) -> dict[str, str]:
        """Each linear layer's route in the current (or last) step, by block name."""
        return {block.name: block.route for block in self.linear}

    def task_passes(self, roots: TaskRoots, passes: Passes, first: bool = True, micro: int = 1,
                    preferred: Concrete | None = None) -> Concrete:
        """A micro-batch's K passes: contracted inside one batched call where it can
        (:mod:`._contracted`), else ``∂Lₖ/∂y`` at the activations-route outputs and the rows of
        every other block. Returns the passes used."""
        k_total = roots.num_tasks
        if first:
            plan_routes(self.linear, self.force, k_total)
        elif self.contracted is not None:  # a second micro-batch: the first one's operands
            self._materialise()
        used: Concrete | None = None
        if first and self._contractible(roots, passes, preferred):
            used = self._contract(roots, passes, preferred)
        elif first and self._may_contract():  # kept for a contraction that did not come
            self._as_the_loop_keeps(k_total)
        if used is None or used == "loop":
            used = self._kept_passes(roots, passes if used is None else "loop", first,
                                     preferred)
        if not first:
            promote_routes(self.linear, self.force, k_total, micro)
        self.num_tasks, self._stepping = k_total, True
        self.tops.clear()
        return used

    def _as_the_loop_keeps(self, k_total: int) -> None:
        """Drop what only a contraction would have kept; the routes planned again."""
        for block in self.linear:
            for call in block.calls:
                if not call.loop:
                    call.input = call.output = None
        plan_routes(self.linear, self.force, k_total)

    def _contractible(self, roots: TaskRoots, passes: Passes,
                      preferred: Concrete | None) -> bool:
        """Whether this micro-batch's passes are contracted: every call kept, no tensor hook
        on a shared parameter (it would also see the weighted write-back), and batched passes
        asked for by name or ``auto``'s rule (:func:`._routes.contract_by_default`)."""
        if not self._may_contract() or any(tensor_hooked(p) for p in self.params):
            return False
        if self.by_name:
            return True
        return preferred != "loop" and contract_by_default(self.linear, roots.num_tasks)

    def _contract(self, roots: TaskRoots, passes: Passes,
                  preferred: Concrete | None) -> Concrete | None:
        """Contract the passes (:func:`._contracted.contract_passes`); the passes to run
        instead where that could not (None: as asked)."""
        hooked = self._hooked_blocks(roots)
        rows = [block for block in self.blocks if all(block is not h for h in hooked)]
        cut = trunk_cut(roots.scaled, self.tops, self.params)
        gram, ran = contract_passes(roots, hooked, rows, passes, cut)
        if gram is None:
            if not ran:  # no batching rule: the loop from now on, as a fallback sticks
                self.contract = False
            return None if ran else "loop"
        calls = [list(block.calls) for block in self.linear]
        for block in self.linear:
            block.calls.clear()
        self.contracted = ContractedStep(roots, gram, calls, passes, preferred)
        return "batched"

    def _hooked_blocks(self, roots: TaskRoots) -> list[Block]:
        """The linear blocks contracted from their recorded calls: every call kept and
        unchanged, and no parameter used outside them (those take autograd's rows)."""
        self._check_recorded(roots)  # the activations-route layers' checks, as in the passes
        keep_exact(self.linear, self.force, roots.scaled, roots.num_tasks, True)
        called = [block for block in self.linear  # an output edited in place: rows
                  if block.calls and all(call.output is not None and _unchanged(call)
                                         for call in block.calls)]
        unsure = [block for block in called if block.route == "rows"]
        wrong = {id(block) for block in inexact(unsure, roots.scaled)} if unsure else set()
        return [block for block in called if id(block) not in wrong]

    def _materialise(self) -> None:
        """The contracted micro-batch's operands after all, from its kept graph; the step
        (and every later one) keeps them (a second micro-batch, or a process group)."""
        step, self.contracted = self.contracted, None
        assert step is not None
        self.keep_operands = True
        current = [block.calls for block in self.linear]
        try:
            for block, calls in zip(self.linear, step.calls):
                block.calls = calls
            self._kept_passes(step.roots, step.passes, True, step.preferred)
        finally:
            for block, calls in zip(self.linear, current):
                block.calls = calls

    def _kept_passes(self, roots: TaskRoots, passes: Passes, first: bool,
                     preferred: Concrete | None) -> Concrete:
        """The passes into each block's operands: output gradients or rows."""
        k_total = roots.num_tasks
        keep_exact(self.linear, self.force, roots.scaled, k_total, first)
        stacks = StackSink(self._check_recorded(roots), k_total)
        row_blocks = [block for block in self.blocks if block.route == "rows"]
        sinks: list[PassSink] = [stacks]
        for block in row_blocks:
            if block.rows is None:  # the step's first pass into this block
                block.reached = [False] * len(block.params)
            sinks.append(RowsSink(block.layout, block.rows_buffer(k_total),
                                  block.rows is not None, block.reached))
        used = run_passes(roots, sinks, self.device, passes=passes, preferred=preferred)
        self._keep_activations(stacks.stacks, k_total)
        for block in row_blocks:
            block.rows = block.rows_buffer(k_total)
        return used

    def _keep_activations(self, stacks: list[Tensor | None], k_total: int) -> None:
        """Each activations-route call's input and output gradient, as rows; the calls go."""
        gradients = iter(stacks)
        for block in self.linear:
            if block.route == "activations":
                for call, d in zip(block.calls, gradients):
                    if d is not None:
                        assert call.input is not None
                        block.inputs.append(rows_input(block.module, call.input.detach()))
                        block.output_grads.append(rows_grad(block.module, d, k_total))
            block.calls.clear()

    def reduce_over_ranks(self, k_total: int, group: Any) -> None:
        """Every rank gets the full batch's operands: routes agreed, activations gathered,
        rows averaged."""
        if self.contracted is not None:  # the Gramian of the ranks' mean needs the operands
            self._materialise()
        if self.linear:  # activations only where every rank has them
            local = torch.tensor([block.route == "activations" for block in self.linear])
            for block, kept in zip(self.linear, all_ranks_true(local, group).tolist()):
                if not kept and block.route == "activations":
                    block.to_rows(k_total)
        size = dist.get_world_size(group)
        for block in self.linear:
            if block.route == "activations":
                _gather_operands(block, k_total, size, group)
        rows: list[Tensor] = []
        for block in self.blocks:
            if block.route == "rows":
                if block.rows is None:
                    block.rows = block.rows_buffer(k_total).zero_()
                block.reached = [True] * len(block.params)  # another rank may have reached them
                rows.append(block.rows)
        all_reduce_mean_(rows, group)

    def gramian(self, k_total: int, device: torch.device) -> Tensor:
        """``G Gᵀ`` ``[K, K]`` in float64, summed block by block."""
        if self.contracted is not None:
            return self.contracted.gram
        gram = torch.zeros(k_total, k_total, dtype=torch.float64, device=device)
        for block in self.blocks:
            if block.route == "activations":
                x, d = block.operands()
                if d is not None:
                    weight, bias = block.linear_params()
                    gram += linear_gramian(x, d, weight, bias, route="activations")
            elif block.rows is not None:
                gram += compute_gramian(block.rows)
        return gram

    def weighted_update(self, weights: Tensor) -> WriteBack:
        """``Σₖ wₖ ∂Lₖ/∂θ`` for every shared parameter the step reached, nothing written."""
        if self.contracted is not None:
            return self.contracted.weighted_update([p for b in self.blocks for p in b.params],
                                                   weights)
        params: list[Tensor] = []
        parts: list[Tensor | None] = []
        owned: list[bool] = []
        for block in self.blocks:
            if block.route == "activations":
                found = _activations_update(block, weights)
            elif block.rows is not None:
                found = _rows_update(block, weights)
            else:
                continue
            params += [p for p, _ in found]
            parts += [part for _, part in found]
            owned += [block.route == "activations"] * len(found)
        return WriteBack(params, parts, owned=owned)


def _gather_operands(block: Block, k_total: int, size: int, group: Any) -> None:
    """All-gather an activations-route layer's ``x`` and ``Dₖ`` (divided by the world size)."""
    mod = block.module_layer()
    assert block.form is not None
    width_in, width_out = block.form
    x, d = block.operands()
    if d is None:  # no output gradient here: an empty share
        dtype = torch.promote_types(mod.weight.dtype, torch.float32)
        x = mod.weight.new_zeros(0, width_in, dtype=dtype)
        d = mod.weight.new_zeros(k_total, 0, width_out, dtype=dtype)
    n = x.shape[0]
    block.inputs = [all_gather_columns(x.reshape(1, -1), group, "gramian")
                    .view(size * n, width_in)]
    block.output_grads = [all_gather_columns(d.reshape(k_total, -1), group, "gramian")
                          .view(k_total, size * n, width_out).div_(size)]


def _activations_update(block: Block, weights: Tensor) -> list[tuple[Tensor, Tensor | None]]:
    """``(Σₖ wₖ Dₖ)ᵀ x`` (weight) and ``Σₙ Σₖ wₖ Dₖ`` (bias), where shared and reached."""
    x, d = block.operands()
    if d is None:
        return []
    dw = torch.tensordot(weights.to(d.dtype), d, 1)  # [N, o]
    return [(p, block.linear_grad(p, x, dw)) for p in block.params]


def _rows_update(block: Block, weights: Tensor) -> list[tuple[Tensor, Tensor | None]]:
    """``wᵀ G_b`` cut per parameter (None where no task of the step reached it)."""
    assert block.rows is not None
    combined = combine_rows(weights, block.rows)
    return [(p, combined[start:stop] if hit else None)
            for hit, (p, start, stop) in zip(block.reached, block.layout.slices())]


def _hook_layer(ref: weakref.ReferenceType[GramianRecorder], block: Block) -> Any:
    """The forward hook recording ``block``'s calls, first among the layer's hooks."""
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             output: Any, hook_id: int) -> None:
        recorder = ref()
        if recorder is not None:
            if torch.compiler.is_compiling():
                raise RuntimeError(_COMPILED)
            recorder.record(block, args, kwargs, output, hook_id)

    return record_calls(block.module, hook, with_kwargs=True)


def _make_top_hook(ref: weakref.ReferenceType[GramianRecorder]) -> Any:
    """A forward hook on a root module: its output, where the contracted passes may start."""
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        recorder = ref()
        if (recorder is not None and torch.is_grad_enabled() and isinstance(output, Tensor)
                and output.requires_grad):
            recorder.tops.append((output, output._version))

    return hook
