"""``gramian`` mode: the Gramian ``G Gᵀ`` block by block, each linear layer by its cheaper route.

The trunk is cut into *blocks*: a module with shared parameters of its own is one block
(with all of its sub-modules, e.g. ``nn.MultiheadAttention`` and its ``out_proj``); a module
without direct parameters is split into its children. A forward hook records the input and
output of every layer of linear form (``nn.Linear``; ``nn.Conv1d`` / ``nn.Conv2d``, whose rows
are the batch × output positions and ``x`` the unfolded patches: :mod:`._layers`). Each
(``y = x Wᵀ + b``, ``x`` ``[N, i]``, ``Dₖ = ∂Lₖ/∂y`` ``[N, o]``) takes one of two exact
routes, chosen per layer and per step
from its shapes by the cost model of :mod:`gradbalance.modes._costs` (time and memory; the
first micro-batch decides, a layer whose rows grow over later micro-batches moves to rows):

* **activations**: the K passes stop at ``y`` (autograd skips the weight-gradient kernel)
  and keep ``Dₖ`` and ``x``; the block is ``⟨Dᵢᵀx, Dⱼᵀx⟩ = Σ_{n,m} (Dᵢ Dⱼᵀ)_{nm} (x xᵀ)_{nm}``
  (``N²·i + K²N²·o`` flops, no weight-sized tensor: large layers, few rows) and the
  write-back ``(Σₖ wₖ Dₖ)ᵀ x``;
* **rows**: the K passes ask for the layer's parameters, so each forms ``Dₖᵀx`` into a
  ``[K, P_b]`` block, as ``matrix`` mode does (many rows: convolutions' and transformers'
  token rows); the block is ``G_b G_bᵀ``, the write-back ``wᵀ G_b``.

Every other block takes the rows. ``G Gᵀ = Σ_b G_b G_bᵀ`` is summed in float64 and one
weighted write-back follows — no second backward through the trunk. The rows live in
buffers kept across steps (no allocation per step); ``layer_routes`` says which route each
layer took.

Each backward keeps only these operands (the linear inputs detached) and lets the graph go.
Micro-batches: the Gramian of a sum of micro-batches is not the sum of their Gramians, but
the full batch's ``x`` and ``Dₖ`` are the micro-batches' concatenations along N and its rows
their sums, so every route above stays exact.

Data parallel (W ranks, equal shards): the ranks agree on the routes first (one all-reduce
of one integer per layer; a layer any rank has on rows is moved to rows everywhere, exactly),
then all-gather each activations-route layer's ``x`` and ``Dₖ`` (``Dₖ`` divided by W: each
loss is the mean of the ranks' means) and average every block's rows. Every rank then holds
the full batch's operands: the same Gramian, the same weights, and the full-batch write-back
with no further reduction. Traffic per activations-route layer: ``W·N·(i + K·o)`` numbers,
small next to ``o·i`` where that route is taken.

Reference: the Gramian-based Jacobian descent of Quinton & Rey, "Jacobian Descent for
Multi-Objective Optimization" (2024), §6.

Requirements of the activations route (checked where possible, with a clear error): the
layer's shared parameters are used only through its ``forward`` (no weight tying with another
layer), and its input and output are not modified in place afterwards
(``nn.ReLU(inplace=True)`` right after it); every shared parameter belongs to a module of
``modules``. Forward passes
run under grad between two backward calls are recorded: evaluate under ``torch.no_grad()``.
A layer that a micro-batch does not call is fine when the losses do not depend on it (the
losses' graph is searched then); a parameter no micro-batch reaches keeps its ``.grad``.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .._amp import finite_step, nonfinite_error, unscaled_gramian
from .._checks import check_int
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper, scales_whole_rows
from ..distributed import (
    _comm_device,
    all_gather_columns,
    all_reduce_grads_and_losses_,
    all_reduce_mean_,
)
from ..gramian import compute_gramian, linear_gramian
from ..stats import StepStats, build_stats
from ..taskgrads import ParamLayout, Passes, TaskRoots, _write_part, _write_row, resolve_passes
from ._costs import LayerCosts, LinearShape, flops_per_byte, layer_costs
from ._engine import (
    StepInput,
    WriteBack,
    commit,
    heads_backward_,
    reaches,
    reject_features,
    settle,
)
from ._layers import LAYER_TYPES, linear_form, rows_grad, rows_input

__all__ = ["GramianMode", "GramianRecorder"]

#: Recorded forwards of one layer past which a forgotten torch.no_grad() is likely.
_MANY_CALLS = 64


@dataclass
class _Call:
    """One recorded forward: its rows ``n``; its input and output only where the layer may
    take the activations route (a call bound for the rows keeps no tensor alive)."""

    n: int
    input: Tensor | None = None
    output: Tensor | None = None
    versions: tuple[int, int] = (0, 0)


@dataclass
class _Block:
    module: nn.Module
    name: str
    params: list[Tensor]
    form: tuple[int, int] | None  # (i, o) of a layer with a linear form, else None
    calls: list[_Call] = field(default_factory=list)  # recorded since the last backward
    # a layer of linear form: this step's route, "rows" or "activations" (other blocks: always rows)
    route: str = "rows"
    # the step so far, activations route: the inputs [N, i] and output gradients [K, N, o]
    inputs: list[Tensor] = field(default_factory=list)
    output_grads: list[Tensor] = field(default_factory=list)
    # rows route: the rows [K, P_b] summed over the micro-batches (None: none yet this step),
    # written into ``buffer``, which persists across steps (no allocation per step)
    rows: Tensor | None = None
    buffer: Tensor | None = None
    # rows route: whether some task of the step reached each of ``params``
    reached: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layout = ParamLayout(self.params)

    @property
    def linear(self) -> bool:
        """Whether the block is a layer of linear form (``nn.Linear``, a convolution)."""
        return self.form is not None

    def forget(self) -> None:
        self.calls.clear()
        self.inputs.clear()
        self.output_grads.clear()
        self.rows = None
        self.reached = []

    def rows_buffer(self, k_total: int) -> Tensor:
        """The persistent ``[K, P_b]`` storage of the rows."""
        if self.buffer is None or self.buffer.shape[0] != k_total:
            self.buffer = torch.empty(k_total, self.layout.numel, dtype=self.layout.dtype,
                                      device=self.layout.device)
        return self.buffer


def _find_blocks(roots: Sequence[nn.Module], params: Sequence[Tensor]) -> list[_Block]:
    wanted = {id(p) for p in params}
    blocks: list[_Block] = []
    seen: set[int] = set()

    def visit(module: nn.Module, name: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if any(id(p) in wanted for p in module.parameters(recurse=False)):
            own: list[Tensor] = [p for p in module.parameters() if id(p) in wanted]
            form = linear_form(module)
            blocks.append(_Block(module, name or type(module).__name__, own, form))
            return
        for child_name, child in module.named_children():
            visit(child, f"{name}.{child_name}" if name else child_name)

    for i, root in enumerate(roots):
        visit(root, "" if len(roots) == 1 else f"modules[{i}]")
    covered = {id(p) for block in blocks for p in block.params}
    for i, p in enumerate(params):
        if id(p) not in covered:
            raise ValueError(
                f"shared_params[{i}] (shape {tuple(p.shape)}) is not a parameter of any module "
                f"in modules; mode='gramian' needs the trunk module(s) owning every shared "
                f"parameter, e.g. modules=model.trunk"
            )
    return blocks


class GramianRecorder:
    """Forward hooks on the trunk's linear blocks; the Gramian and the weighted write-back.

    Args:
        modules: the module(s) owning the shared parameters (e.g. ``model.trunk``).
        params: the shared parameters; each must belong to one of ``modules``.
    """

    def __init__(self, modules: nn.Module | Iterable[nn.Module], params: Sequence[Tensor]) -> None:
        roots = [modules] if isinstance(modules, nn.Module) else list(modules)
        if not roots or not all(isinstance(m, nn.Module) for m in roots):
            raise ValueError(
                f"Invalid modules: {modules!r} (expected an nn.Module or a list of them, "
                f"the trunk owning shared_params)"
            )
        if any(hasattr(m, "_orig_mod") for m in roots):  # torch.compile's OptimizedModule
            raise RuntimeError(_COMPILED)
        self.blocks = _find_blocks(roots, params)
        self.linear = [block for block in self.blocks if block.linear]
        self.other = [block for block in self.blocks if not block.linear]
        #: a route forced on every layer of linear form (``"rows"`` or ``"activations"``), or
        #: by block name (a dict); None: each layer's cost model decides
        self.force: str | dict[str, str] | None = None
        #: K of the last step's passes (None before the first): a forward bound for the rows
        #: at this K keeps no tensor
        self.num_tasks: int | None = None
        self._stepping = False  # a micro-batch of the current step has run its passes
        ref = weakref.ref(self)
        self._handles = [
            block.module.register_forward_hook(_make_hook(ref, block), with_kwargs=True)
            for block in self.linear
        ]

    # -- recording ----------------------------------------------------------------------
    def record(self, block: _Block, args: tuple[Any, ...], kwargs: dict[str, Any],
               output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if not isinstance(output, Tensor) or not output.requires_grad:
            return
        if "Compiled" in type(output.grad_fn).__name__:  # an output of a compiled graph
            raise RuntimeError(_COMPILED)
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, Tensor):
            raise RuntimeError(
                f"mode='gramian': module {block.name} ({type(block.module).__name__}) was "
                f"called without an input tensor it can record (found {type(x).__name__}); "
                f"call it as layer(x)"
            )
        assert block.form is not None
        n = output.numel() // max(block.form[1], 1)
        if self._keeps(block, n):
            block.calls.append(_Call(n, x, output, (x._version, output._version)))
        else:
            block.calls.append(_Call(n))
        if len(block.calls) == _MANY_CALLS:
            warnings.warn(
                f"mode='gramian' holds {_MANY_CALLS} forwards of layer {block.name!r} since "
                f"the last backward(): every forward under grad is kept until the next "
                f"backward() or reset(); evaluate under torch.no_grad()",
                RuntimeWarning, stacklevel=2)

    def _keeps(self, block: _Block, n: int) -> bool:
        """Whether a forward of ``n`` rows must keep its input and output: not where the
        layer takes the rows for sure (forced; a later micro-batch of a step on rows; or the
        rows at these rows and the last step's K, 2 before the first: a layer whose tensors
        were not kept takes the rows in that step; the last K is in ``state_dict``, so a
        resumed run takes the same routes). Holding the tensors of a layer that takes the
        rows keeps its output alive through the K passes for nothing (measured 1.3x on the
        CNN of the benchmarks)."""
        forced = self._forced(block)
        if forced is not None:
            return forced == "activations"
        if self._stepping:
            return block.route == "activations"
        total = n + sum(call.n for call in block.calls)
        k = 2 if self.num_tasks is None else self.num_tasks  # K = 2 before the first step
        return self._costs(block, total, k, 1).route == "activations"

    def clear(self) -> None:
        """Forget the step: recorded calls, output gradients, inputs and rows."""
        self._stepping = False
        for block in self.blocks:
            block.forget()

    def remove(self) -> None:
        """Remove the forward hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()

    def _check_recorded(self, roots: TaskRoots, every: bool = False) -> list[Tensor]:
        """The recorded outputs of the activations-route layers; such a layer without a
        recorded call must not be on the losses' graph (then it is unused, and its parameters
        keep their ``.grad``). ``every``: check every linear layer, whatever its route."""
        outputs: list[Tensor] = []
        for block in self.linear:
            if block.route != "activations" and not every:
                continue
            if not block.calls:
                if not reaches(roots.scaled, block.params):
                    continue
                raise RuntimeError(
                    f"mode='gramian': module {block.name} ({type(block.module).__name__}) was "
                    f"not called as a module during the forward under grad, yet the losses "
                    f"depend on its parameters; run the forward (with the buffer built "
                    f"before it) before backward(), or use mode='matrix' if the parameters are "
                    f"used another way"
                )
            for call in block.calls:
                if call.input is None or call.output is None:  # bound for the rows
                    continue
                if (call.input._version, call.output._version) != call.versions:
                    raise RuntimeError(
                        f"mode='gramian': the output or input of module {block.name} was "
                        f"modified in place after its forward (e.g. nn.ReLU(inplace=True)); "
                        f"use out-of-place ops in the trunk or mode='matrix'"
                    )
                outputs.append(call.output)
        return outputs

    # -- the per-layer route --------------------------------------------------------------
    @property
    def routes(self) -> dict[str, str]:
        """Each layer of linear form's route in the current (or last) step, by block name:
        ``"rows"`` or ``"activations"``."""
        return {block.name: block.route for block in self.linear}

    def _costs(self, block: _Block, n: int, k_total: int, micro: int) -> LayerCosts:
        assert block.form is not None
        weight, bias = self._linear_params(block)
        shape = LinearShape(n, *block.form, weight, bias)
        return layer_costs(shape, k_total, micro, block.layout.params[0].element_size(),
                           flops_per_byte(block.layout.device.type), total_rows=n)

    def _forced(self, block: _Block) -> str | None:
        force = self.force
        route = force.get(block.name) if isinstance(force, dict) else force
        if route not in (None, "rows", "activations"):
            raise ValueError(
                f"Invalid force: {route!r} for {block.name} (expected 'rows', 'activations' "
                f"or None)"
            )
        return route

    def _plan(self, k_total: int) -> None:
        """Each linear block's route for the step, from its first micro-batch's calls: the
        cheaper of :func:`~gradbalance.modes._costs.layer_costs` (rows without calls)."""
        for block in self.linear:
            forced = self._forced(block)
            if forced is not None:
                block.route = forced
            elif not block.calls or any(call.output is None for call in block.calls):
                block.route = "rows"  # no call, or a call whose tensors were not kept
            else:
                n = sum(call.n for call in block.calls)
                block.route = self._costs(block, n, k_total, 1).route

    def _to_rows(self, block: _Block, k_total: int) -> None:
        """Move an activations-route block to rows for the rest of the step: its rows are
        ``Dₖᵀx`` (weight) and ``Σₙ Dₖ`` (bias) of the operands so far (exact)."""
        x, d = self._linear_operands(block, k_total)
        buffer = block.rows_buffer(k_total)
        mod = block.module
        assert isinstance(mod, LAYER_TYPES)
        for p, (_, start, stop) in zip(block.params, block.layout.slices()):
            part = buffer[:, start:stop]
            if d is None:
                part.zero_()
            elif p is mod.weight:
                part.copy_(torch.matmul(d.transpose(1, 2), x).reshape(k_total, -1))
            else:
                part.copy_(d.sum(dim=1))
        block.rows = buffer
        block.reached = [d is not None] * len(block.params)
        block.route = "rows"
        block.inputs.clear()
        block.output_grads.clear()

    def _promote(self, k_total: int, micro: int) -> None:
        """After a later micro-batch: an activations-route layer whose rows have become the
        cheaper route (its rows ``N`` grew) moves to rows, unless its route is forced."""
        for block in self.linear:
            if block.route != "activations" or self._forced(block) is not None:
                continue
            n = sum(x.shape[0] for x in block.inputs)
            if n and self._costs(block, n, k_total, micro).route == "rows":
                self._to_rows(block, k_total)

    # -- stage 1: the K passes ------------------------------------------------------------
    def task_passes(self, roots: TaskRoots, batched: bool, first: bool = True,
                    micro: int = 1) -> None:
        """K passes for this micro-batch (``micro``-th of the step): ``∂Lₖ/∂y`` at the
        recorded outputs of the activations-route layers (kept with their inputs) and the
        rows of every other block (added to the step's)."""
        k_total = roots.num_tasks
        if first:
            self._plan(k_total)
        outputs = self._check_recorded(roots)
        row_blocks = [block for block in self.blocks if block.route == "rows"]
        params = [p for block in row_blocks for p in block.params]
        n_out = len(outputs)
        stacks: list[Tensor | None] = [None] * n_out
        hits: list[bool] = [False] * len(params)
        if batched:
            losses = roots.scaled
            eye = torch.eye(k_total, dtype=losses.dtype, device=losses.device)
            grads: tuple[Tensor | None, ...] = torch.autograd.grad(
                losses, [*outputs, *params], grad_outputs=eye, is_grads_batched=True,
                allow_unused=True,
            )
            stacks = list(grads[:n_out])
            at = n_out
            for block in row_blocks:
                buffer, accumulate = block.rows_buffer(k_total), block.rows is not None
                for (_, start, stop) in block.layout.slices():
                    g = grads[at]
                    _write_part(buffer[:, start:stop], g, accumulate)
                    hits[at - n_out] = g is not None
                    at += 1
        else:
            previous: tuple[Tensor | None, ...] = ()
            for k in range(k_total):
                grads = roots.grad(k, [*outputs, *params], retain_graph=k < k_total - 1)
                for j, g in enumerate(grads[:n_out]):
                    if g is None:
                        continue
                    stack = stacks[j]
                    if stack is None:
                        stack = stacks[j] = torch.zeros(
                            (k_total, *g.shape), dtype=g.dtype, device=g.device
                        )
                    stack[k].copy_(g)
                at = n_out
                for block in row_blocks:
                    part = grads[at : at + len(block.params)]
                    _write_row(block.rows_buffer(k_total)[k], part, block.layout,
                               block.rows is not None)
                    for j, g in enumerate(part):
                        hits[at - n_out + j] = hits[at - n_out + j] or g is not None
                    at += len(block.params)
                # freed once the next pass has allocated its own (no page faults per pass)
                previous = grads  # noqa: F841
        at = 0
        for block in self.linear:
            if block.route != "activations":
                block.calls.clear()
                continue
            for call in block.calls:
                d = stacks[at]
                at += 1
                if d is not None:
                    assert call.input is not None
                    block.inputs.append(rows_input(block.module, call.input.detach()))
                    block.output_grads.append(rows_grad(block.module, d, k_total))
            block.calls.clear()  # the graph may go
        at = 0
        for block in row_blocks:
            if block.rows is None:
                block.rows = block.rows_buffer(k_total)
                block.reached = [False] * len(block.params)
            for i in range(len(block.params)):
                block.reached[i] = block.reached[i] or hits[at + i]
            at += len(block.params)
        if not first:
            self._promote(k_total, micro)
        self.num_tasks, self._stepping = k_total, True

    def reduce_over_ranks(self, k_total: int, group: Any) -> None:
        """Give every rank the full batch's operands. The routes are agreed first (one
        all-reduce): a layer is on the activations route only where every rank took it, a
        rank's activations move to rows otherwise (exact). Then activations-route inputs and
        output gradients are all-gathered (gradients divided by the world size) and every
        block's rows averaged. ``group`` must be resolved (not None)."""
        size = dist.get_world_size(group)
        if self.linear:
            flags = torch.tensor([int(block.route == "rows") for block in self.linear],
                                 dtype=torch.int32)
            agreed = flags.to(_comm_device(group, flags.device))
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
            for block, rows in zip(self.linear, agreed.tolist()):
                if rows and block.route == "activations":
                    self._to_rows(block, k_total)
        for block in self.linear:
            if block.route != "activations":
                continue
            mod = block.module
            assert isinstance(mod, LAYER_TYPES) and block.form is not None
            width_in, width_out = block.form
            x, d = self._linear_operands(block, k_total)
            if d is None:  # no output gradient here: an empty share (checked below)
                dtype = torch.promote_types(mod.weight.dtype, torch.float32)
                x = mod.weight.new_zeros(0, width_in, dtype=dtype)
                d = mod.weight.new_zeros(k_total, 0, width_out, dtype=dtype)
            n = x.shape[0]
            block.inputs = [all_gather_columns(x.reshape(1, -1), group, "gramian")
                            .view(size * n, width_in)]
            block.output_grads = [all_gather_columns(d.reshape(k_total, -1), group, "gramian")
                                  .view(k_total, size * n, width_out).div_(size)]
        rows = []
        for block in self.blocks:
            if block.route != "rows":
                continue
            if block.rows is None:
                block.rows = block.rows_buffer(k_total).zero_()
            block.reached = [True] * len(block.params)  # another rank may have reached them
            rows.append(block.rows)
        all_reduce_mean_(rows, group)

    # -- stage 2: the Gramian ---------------------------------------------------------
    def gramian(self, k_total: int, device: torch.device) -> Tensor:
        """``G Gᵀ`` ``[K, K]`` in float64, summed block by block."""
        gram = torch.zeros(k_total, k_total, dtype=torch.float64, device=device)
        for block in self.blocks:
            if block.route == "activations":
                x, d = self._linear_operands(block, k_total)
                if d is not None:
                    weight, bias = self._linear_params(block)
                    gram += linear_gramian(x, d, weight, bias, route="activations")
            elif block.rows is not None:
                gram += compute_gramian(block.rows)
        return gram

    @staticmethod
    def _linear_params(block: _Block) -> tuple[bool, bool]:
        """Whether the layer's weight and its bias are among the shared parameters."""
        mod = block.module
        assert isinstance(mod, LAYER_TYPES)
        ids = {id(p) for p in block.params}
        return id(mod.weight) in ids, mod.bias is not None and id(mod.bias) in ids

    @staticmethod
    def _linear_operands(block: _Block, k_total: int) -> tuple[Tensor, Tensor | None]:
        """``x`` ``[N, i]`` and ``D`` ``[K, N, o]`` of the step so far, in at least float32."""
        mod = block.module
        assert isinstance(mod, LAYER_TYPES)
        if not block.output_grads:
            return torch.empty(0), None
        dtype = torch.promote_types(mod.weight.dtype, torch.float32)
        xs = [x.to(dtype) for x in block.inputs]
        ds = [d.to(dtype) for d in block.output_grads]
        if len(ds) == 1:
            return xs[0], ds[0]
        return torch.cat(xs), torch.cat(ds, dim=1)

    # -- stage 3: the weighted gradient, written last ------------------------------------
    def weighted_update(self, weights: Tensor) -> WriteBack:
        """``Σₖ wₖ ∂Lₖ/∂θ`` for every shared parameter the step reached, block by block,
        computed in full before anything is written (:meth:`WriteBack.commit_`)."""
        params: list[Tensor] = []
        parts: list[Tensor | None] = []
        owned: list[bool] = []
        for block in self.linear:
            if block.route != "activations":
                continue
            x, d = self._linear_operands(block, weights.shape[0])
            if d is None:
                continue
            dw = torch.tensordot(weights.to(d.dtype), d, 1)  # [N, o]
            weight, bias = self._linear_params(block)
            mod = block.module
            assert isinstance(mod, LAYER_TYPES)
            if weight:
                params.append(mod.weight)
                parts.append(dw.T @ x)
                owned.append(True)
            if bias:
                assert mod.bias is not None
                params.append(mod.bias)
                parts.append(dw.sum(dim=0))
                owned.append(True)
        for block in self.blocks:
            if block.route != "rows" or block.rows is None:
                continue
            combined = weights.to(block.rows.dtype) @ block.rows
            start = 0
            for p, hit in zip(block.params, block.reached):
                params.append(p)
                parts.append(combined[start : start + p.numel()] if hit else None)
                owned.append(False)
                start += p.numel()
        return WriteBack(params, parts, owned=owned)


_COMPILED = (
    "mode='gramian' cannot record a torch.compile'd trunk: the compiled graph hides the "
    "layer inputs and output gradients its Gramian is built from. Use mode='matrix' with a "
    "compiled trunk, or leave the trunk uncompiled (docs/integrations.md, torch.compile)"
)


def _make_hook(ref: weakref.ReferenceType[GramianRecorder], block: _Block) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             output: Any) -> None:
        recorder = ref()
        if recorder is not None:
            if torch.compiler.is_compiling():
                raise RuntimeError(_COMPILED)
            recorder.record(block, args, kwargs, output)

    return hook


class GramianMode:
    """``G Gᵀ`` from the recorder, the weights, one weighted write-back.

    The same update as ``matrix`` mode for every weighted balancer. With a loss scale ``s``
    the Gramian of the scaled losses is divided by ``s²``; the write-back stays scaled, as
    ``scaler.unscale_`` expects. Under data parallelism the heads' ``.grad`` and the losses
    are averaged and the recorder gives every rank the full batch's operands, so every rank
    writes the full-batch update. A row clipper with a ``coefficients(norms)`` rule on
    2-norms (``TaskClip``, ``TaskAutoClip``) acts on the Gramian: ``cᵢ cⱼ (G Gᵀ)ᵢⱼ`` for the
    balancer, ``w ⊙ c`` for the write-back.
    """

    mode: ClassVar[str] = "gramian"
    matrix: Tensor | None = None  # never a [K, P] matrix

    def __init__(self, layout: ParamLayout, head_params: list[Tensor], passes: Passes,
                 modules: Any = None) -> None:
        if modules is None:
            raise ValueError(
                "mode='gramian' needs modules=...: the module(s) owning shared_params, "
                "e.g. TaskGradBuffer(..., mode='gramian', modules=model.trunk)"
            )
        self.recorder = GramianRecorder(modules, layout.params)
        self.head_params = head_params
        # no first-step measurement here: the passes resolve by device (loop on CPU)
        self.batched = resolve_passes(passes, layout.device) == "batched"
        self._micro = 0  # micro-batches of the step so far

    @property
    def layer_routes(self) -> dict[str, str]:
        """The route of each trunk layer of linear form (``nn.Linear``, a convolution) in
        the current (or last) step, by module name: ``"activations"`` (its Gramian from
        inputs and output gradients) or ``"rows"`` (per-task weight gradients, as in
        ``matrix`` mode)."""
        return self.recorder.routes

    def check_backward(self, features: Tensor | None, count: int, reused: bool) -> None:
        reject_features(self.mode, features)

    def backward(self, roots: TaskRoots, first: bool, features: Tensor | None = None) -> None:
        heads_backward_(roots, self.head_params)
        self._micro = 1 if first else self._micro + 1
        self.recorder.task_passes(roots, self.batched, first, self._micro)

    def check_apply(self, balancer: Balancer, clip: RowClipper | None) -> None:
        if not balancer.from_gramian:
            raise TypeError(
                f"{type(balancer).__name__} needs the task-gradient rows, not only the "
                f"Gramian; use mode='matrix' (or 'features')"
            )
        if clip is not None and not scales_whole_rows(clip):
            raise ValueError(
                f"clip={clip!r} needs the task-gradient rows; mode='gramian' applies only "
                f"2-norm clipping that scales whole rows (TaskClip, TaskAutoClip with "
                f"norm_type=2) to the Gramian; use one of those or mode='matrix'"
            )

    def apply(self, balancer: Balancer, step: StepInput) -> StepStats:
        losses, scale = step.losses, step.scale
        try:
            if step.group is not None:
                losses = all_reduce_grads_and_losses_(self.head_params, losses, step.group)
                self.recorder.reduce_over_ranks(losses.shape[0], step.group)
            gram = unscaled_gramian(scale, gramian=self.recorder.gramian(losses.shape[0],
                                                                         losses.device))
            finite = finite_step(gram, scale, self.head_params, step.group)
            pre_clip = coef = None
            if finite and step.clip is not None:  # row k scaled by cₖ: G Gᵀ by cᵢ cⱼ
                pre_clip = torch.diagonal(gram).clamp_min(0).sqrt()
                # coefficients() is optional on RowClipper; check_apply made sure it is here
                coef = step.clip.coefficients(  # type: ignore[attr-defined]  # optional method
                    pre_clip).to(torch.float64)
                gram = gram * coef[:, None] * coef[None, :]
            if finite:
                weights = balancer.compute_weights(gram, losses)
            elif scale is not None:  # the plain sum, non-finite: the scaler skips the step
                weights = torch.ones_like(losses, dtype=torch.float64)
            else:
                raise nonfinite_error()
            update = self.recorder.weighted_update(weights if coef is None else weights * coef)
            finite = settle(update, step, finite)
            stats = build_stats(gram, losses, finite, weights=weights, scale=scale,
                                pre_clip_norms=pre_clip, num_backward=step.count,
                                mode="gramian")
        finally:
            self.recorder.clear()
        commit(update, self.head_params, finite)
        return stats

    def clear(self) -> None:
        self.recorder.clear()

    def state_dict(self) -> dict[str, Any]:
        """The last step's K (``"gramian_tasks"``), which the next forwards use."""
        tasks = self.recorder.num_tasks
        return {} if tasks is None else {"gramian_tasks": tasks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (nothing is measured in this mode: a saved ``passes``
        choice is ignored)."""
        self.recorder.num_tasks = load_tasks(state_dict)


def load_tasks(state_dict: dict[str, Any]) -> int | None:
    """The saved ``"gramian_tasks"`` (None where absent), checked."""
    tasks = state_dict.get("gramian_tasks")
    if tasks is not None:
        check_int("state_dict['gramian_tasks']", tasks, 1,
                  "; pass the output of TaskGradBuffer.state_dict()")
    return tasks
