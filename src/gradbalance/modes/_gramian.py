"""``gramian`` mode: the Gramian ``G Gᵀ`` block by block, without ever holding ``[K, P]``.

The trunk is cut into *blocks*: a module with shared parameters of its own is one block
(with all of its sub-modules, e.g. ``nn.MultiheadAttention`` and its ``out_proj``); a module
without direct parameters is split into its children. A forward hook records each block's
output (and, for ``nn.Linear``, its input). Then:

1. K backward passes give ``∂Lₖ/∂y_b`` for every block output ``y_b`` only: autograd prunes
   every weight-gradient kernel, so each pass costs less than a full backward. Memory:
   K × the block outputs (the activations), never K × P.
2. Per block, ``G_b G_bᵀ`` is accumulated in float64 (``G = [G_1 … G_B]`` so
   ``G Gᵀ = Σ_b G_b G_bᵀ``). ``nn.Linear`` (``y = x Wᵀ + b``, ``x`` ``[N, i]``, ``Dₖ = ∂Lₖ/∂y``
   ``[N, o]``) takes the cheaper of two exact routes:

   * rows: ``G_b[k] = Dₖᵀ x`` — ``2K·N·o·i`` flops and a ``[K, o·i]`` scratch;
   * activations: ``⟨Dᵢᵀx, Dⱼᵀx⟩ = Σ_{n,m} (Dᵢ Dⱼᵀ)_{nm} (x xᵀ)_{nm}`` — ``N²·i + K²N²·o``
     flops, no weight-sized tensor at all (the regime of large layers and small batches).

   Other blocks use one vector-Jacobian product per task on the recorded graph (a
   ``[K, P_b]`` scratch for that block alone).
3. With the weights ``w``, each block gets ``Σₖ wₖ G_b[k]`` from one product with
   ``Σₖ wₖ Dₖ`` — no second backward through the trunk.

Micro-batches: the Gramian of a sum of micro-batches is not the sum of their Gramians, so
each earlier micro-batch is *settled* when the next one's backward starts: an ``nn.Linear``
block keeps its detached inputs and output gradients (the full batch's ``x`` and ``Dₖ`` are
their concatenations along N, so both routes above and the write-back stay exact), any other
block turns its recorded graph into the ``[K, P_b]`` rows, summed over the micro-batches
(``K·P_b`` numbers for those blocks only). The micro-batch's graph is then released. A step
of one micro-batch settles nothing.

Data parallel (W ranks, equal shards): every micro-batch is settled, then the ranks
all-gather each ``nn.Linear``'s ``x`` and ``Dₖ`` (the full batch's are their concatenations,
``Dₖ`` divided by W: each loss is the mean of the ranks' means) and average the other blocks'
rows. Every rank then holds the full batch's operands: the same Gramian, the same weights,
and the full-batch write-back with no further reduction. Traffic per linear layer:
``W·N·(i + K·o)`` numbers, small next to ``o·i`` in the regime where this mode pays.

Reference: the Gramian-based Jacobian descent of Quinton & Rey, "Jacobian Descent for
Multi-Objective Optimization" (2024), §6.

Requirements (checked where possible, with a clear error): every shared parameter belongs to
a module of ``modules`` and is used only inside that module's forward (no weight tying across
blocks); block outputs are not modified in place afterwards (``nn.ReLU(inplace=True)`` right
after a block); every block is called during the forward. Forward passes run under grad
between two steps are all recorded: evaluate under ``torch.no_grad()``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed import all_gather_columns, all_reduce_mean_
from ..gramian import compute_gramian
from ..taskgrads import TaskRoots

__all__ = ["GramianRecorder"]


@dataclass
class _Call:
    outputs: list[Tensor]
    versions: list[int]
    input: Tensor | None = None
    input_version: int = 0


@dataclass
class _Block:
    module: nn.Module
    name: str
    params: list[Tensor]
    linear: bool
    calls: list[_Call] = field(default_factory=list)
    grads: list[list[Tensor | None]] = field(default_factory=list)  # per call, per output
    # settled micro-batches of this step: nn.Linear inputs [N, i] and gradients [K, N, o],
    # or the rows [K, P_b] of any other block, summed
    inputs: list[Tensor] = field(default_factory=list)
    output_grads: list[Tensor] = field(default_factory=list)
    rows: Tensor | None = None

    def forget(self) -> None:
        self.calls.clear()
        self.grads.clear()
        self.inputs.clear()
        self.output_grads.clear()
        self.rows = None


def _tensors_of(output: Any) -> list[Tensor]:
    if isinstance(output, Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _tensors_of(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in _tensors_of(item)]
    return []


def _find_blocks(roots: Sequence[nn.Module], params: Sequence[Tensor]) -> list[_Block]:
    wanted = {id(p) for p in params}
    blocks: list[_Block] = []
    seen: set[int] = set()

    def visit(module: nn.Module, name: str) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        if any(id(p) in wanted for p in module.parameters(recurse=False)):
            own = [p for p in module.parameters() if id(p) in wanted]
            linear = type(module) is nn.Linear
            blocks.append(_Block(module, name or type(module).__name__, own, linear))
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


def _linear_gramian(x: Tensor, d: Tensor, weight: bool, bias: bool) -> Tensor:
    """``G_b G_bᵀ`` of an ``nn.Linear`` from its input ``x`` ``[N, i]`` and ``d`` ``[K, N, o]``."""
    k, n, o = d.shape
    i = x.shape[1]
    gram = torch.zeros(k, k, dtype=torch.float64, device=d.device)
    if bias:
        s = d.sum(dim=1)
        gram += (s @ s.T).double()
    if weight:
        if n * n * (i + k * k * o) < 2 * k * n * o * i + k * k * o * i:
            a = x @ x.T  # [N, N]
            flat = d.reshape(k * n, o)
            m = (flat @ flat.T).view(k, n, k, n).permute(0, 2, 1, 3).reshape(k * k, n * n)
            gram += (m @ a.reshape(n * n)).view(k, k).double()
        else:
            rows = torch.matmul(d.transpose(1, 2), x).reshape(k, o * i)  # [K, o·i]
            gram += compute_gramian(rows)
    return gram


class GramianRecorder:
    """Forward hooks on the trunk's blocks; the Gramian and the weighted write-back per block.

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
        self.blocks = _find_blocks(roots, params)
        self.paused = False
        self.settled = False  # an earlier micro-batch of this step is settled
        ref = weakref.ref(self)
        self._handles = [
            block.module.register_forward_hook(_make_hook(ref, index))
            for index, block in enumerate(self.blocks)
        ]

    # -- recording ----------------------------------------------------------------------
    def record(self, index: int, args: tuple[Any, ...], output: Any) -> None:
        if self.paused or not torch.is_grad_enabled():
            return
        outputs = _tensors_of(output)
        if not outputs:
            return
        block = self.blocks[index]
        call = _Call(outputs, [t._version for t in outputs])
        if block.linear and args and isinstance(args[0], Tensor):
            call.input, call.input_version = args[0], args[0]._version
        block.calls.append(call)

    def clear(self) -> None:
        """Forget every recorded call (and the task gradients of the block outputs)."""
        for block in self.blocks:
            block.forget()
        self.settled = False

    def remove(self) -> None:
        """Remove the forward hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.clear()

    def _check_recorded(self) -> list[Tensor]:
        outputs: list[Tensor] = []
        for block in self.blocks:
            if not block.calls:
                raise RuntimeError(
                    f"mode='gramian': module {block.name} ({type(block.module).__name__}) was "
                    f"not called as a module during the forward under grad, so its shared "
                    f"parameters cannot be reached; run the forward before backward(), or use "
                    f"mode='matrix' if the parameters are used another way"
                )
            for call in block.calls:
                changed = [t._version != v for t, v in zip(call.outputs, call.versions)]
                if any(changed) or (
                    call.input is not None and call.input._version != call.input_version
                ):
                    raise RuntimeError(
                        f"mode='gramian': the output or input of module {block.name} was "
                        f"modified in place after its forward (e.g. nn.ReLU(inplace=True)); "
                        f"use out-of-place ops in the trunk or mode='matrix'"
                    )
                outputs.extend(call.outputs)
        return outputs

    # -- stage 1: task gradients of the block outputs ---------------------------------
    def task_output_grads(self, roots: TaskRoots, batched: bool) -> None:
        """``∂Lₖ/∂y`` for every block output ``y`` recorded since the last backward, kept as
        ``[K, *y.shape]``; an earlier micro-batch of the step is settled first."""
        if any(block.grads for block in self.blocks):
            self.settle(roots.num_tasks)
        outputs = self._check_recorded()
        k_total = roots.num_tasks
        stacks: list[Tensor | None]
        if batched:
            losses = roots.scaled
            eye = torch.eye(k_total, dtype=losses.dtype, device=losses.device)
            stacks = list(torch.autograd.grad(
                losses, outputs, grad_outputs=eye, is_grads_batched=True, retain_graph=True,
                allow_unused=True,
            ))
        else:
            stacks = [None] * len(outputs)
            for k in range(k_total):
                for j, g in enumerate(roots.grad(k, outputs, retain_graph=True)):
                    if g is None:
                        continue
                    stack = stacks[j]
                    if stack is None:
                        stack = stacks[j] = torch.zeros(
                            (k_total, *g.shape), dtype=g.dtype, device=g.device
                        )
                    stack[k].copy_(g)
        pos = 0
        for block in self.blocks:
            block.grads = []
            for call in block.calls:
                block.grads.append(stacks[pos : pos + len(call.outputs)])
                pos += len(call.outputs)

    def settle(self, k_total: int) -> None:
        """Turn the calls that have output gradients into the step's accumulated operands
        (linear inputs and gradients, other blocks' rows) and release their graph."""
        for block in self.blocks:
            done = len(block.grads)
            if block.linear:
                x, d = self._linear_operands(block, k_total, raw=True)
                if d is not None:
                    block.inputs.append(x)
                    block.output_grads.append(d)
            else:
                rows = self._vjp_rows(block, k_total)
                if rows is not None:
                    block.rows = rows if block.rows is None else block.rows.add_(rows)
            del block.calls[:done]
            block.grads.clear()
        self.settled = True

    def reduce_over_ranks(self, k_total: int, group: Any) -> None:
        """Settle everything, then give every rank the full batch's operands: linear inputs
        and output gradients all-gathered (gradients divided by the world size), other
        blocks' rows averaged. ``group`` must be resolved (not None)."""
        self.settle(k_total)
        size = dist.get_world_size(group)
        for block in self.blocks:
            if block.linear:
                mod = block.module
                assert isinstance(mod, nn.Linear)
                x, d = self._linear_operands(block, k_total)
                if d is None:  # no output gradient here: an empty share (checked below)
                    dtype = torch.promote_types(mod.weight.dtype, torch.float32)
                    x = mod.weight.new_zeros(0, mod.in_features, dtype=dtype)
                    d = mod.weight.new_zeros(k_total, 0, mod.out_features, dtype=dtype)
                n = x.shape[0]
                block.inputs = [all_gather_columns(x.reshape(1, -1), group, "gramian")
                                .view(size * n, mod.in_features)]
                block.output_grads = [all_gather_columns(d.reshape(k_total, -1), group,
                                                         "gramian")
                                      .view(k_total, size * n, mod.out_features).div_(size)]
            else:
                if block.rows is None:
                    numel = sum(p.numel() for p in block.params)
                    block.rows = block.params[0].new_zeros(k_total, numel)
                all_reduce_mean_([block.rows], group)

    # -- stage 2: the Gramian ---------------------------------------------------------
    def gramian(self, k_total: int, device: torch.device) -> Tensor:
        """``G Gᵀ`` ``[K, K]`` in float64, summed block by block."""
        if self.settled:
            self.settle(k_total)
        gram = torch.zeros(k_total, k_total, dtype=torch.float64, device=device)
        for block in self.blocks:
            if block.linear:
                x, d = self._linear_operands(block, k_total)
                if d is not None:
                    ids = {id(p) for p in block.params}
                    mod = block.module
                    has_bias = mod.bias is not None and id(mod.bias) in ids
                    gram += _linear_gramian(x, d, id(mod.weight) in ids, has_bias)
                continue
            rows = self._generic_rows(block, k_total)
            if rows is not None:
                gram += compute_gramian(rows)
        return gram

    def _linear_operands(self, block: _Block, k_total: int, raw: bool = False
                         ) -> tuple[Tensor, Tensor | None]:
        """``x`` ``[N, i]`` and ``D`` ``[K, N, o]`` over the settled and the pending calls, in
        at least float32 (``raw``: the pending calls only, in their own dtypes)."""
        mod = block.module
        assert isinstance(mod, nn.Linear)
        xs, ds = ([], []) if raw else (list(block.inputs), list(block.output_grads))
        for call, grads in zip(block.calls, block.grads):
            g = grads[0] if grads else None
            if g is None or call.input is None:
                continue
            xs.append(call.input.detach().reshape(-1, mod.in_features))
            ds.append(g.reshape(k_total, -1, mod.out_features))
        if not ds:
            return torch.empty(0), None
        if not raw:
            dtype = torch.promote_types(mod.weight.dtype, torch.float32)
            xs, ds = [x.to(dtype) for x in xs], [d.to(dtype) for d in ds]
        if len(ds) == 1:
            return xs[0], ds[0]
        return torch.cat(xs), torch.cat(ds, dim=1)

    def _vjp(self, block: _Block, grad_outputs_of: Any) -> list[Tensor | None] | None:
        outs: list[Tensor] = []
        gouts: list[Tensor] = []
        for call, grads in zip(block.calls, block.grads):
            for out, g in zip(call.outputs, grads):
                if g is not None:
                    outs.append(out)
                    gouts.append(grad_outputs_of(g))
        if not outs:
            return None
        return list(torch.autograd.grad(outs, block.params, grad_outputs=gouts,
                                        retain_graph=True, allow_unused=True))

    def _generic_rows(self, block: _Block, k_total: int) -> Tensor | None:
        """The block's ``[K, P_b]`` rows: settled, or from the pending calls' graph."""
        return block.rows if self.settled else self._vjp_rows(block, k_total)

    def _vjp_rows(self, block: _Block, k_total: int) -> Tensor | None:
        numel = sum(p.numel() for p in block.params)
        rows: Tensor | None = None
        for k in range(k_total):
            grads = self._vjp(block, lambda g, k=k: g[k])
            if grads is None:
                return None
            if rows is None:
                rows = torch.zeros(k_total, numel, dtype=block.params[0].dtype,
                                   device=block.params[0].device)
            start = 0
            for p, g in zip(block.params, grads):
                if g is not None:
                    rows[k, start : start + p.numel()].copy_(g.reshape(-1))
                start += p.numel()
        return rows

    # -- stage 3: the weighted gradient into .grad ---------------------------------------
    def write_weighted_(self, weights: Tensor) -> None:
        """``.grad += Σₖ wₖ ∂Lₖ/∂θ`` for every shared parameter, block by block."""
        for block in self.blocks:
            if block.linear:
                self._write_linear(block, weights)
                continue
            if self.settled:
                if block.rows is not None:
                    combined = weights.to(block.rows.dtype) @ block.rows
                    start = 0
                    for p in block.params:
                        _add_grad(p, combined[start : start + p.numel()])
                        start += p.numel()
                continue
            grads = self._vjp(block, lambda g: torch.tensordot(weights.to(g.dtype), g, 1))
            if grads is None:
                continue
            for p, g in zip(block.params, grads):
                if g is not None:
                    _add_grad(p, g)

    def _write_linear(self, block: _Block, weights: Tensor) -> None:
        mod = block.module
        assert isinstance(mod, nn.Linear)
        x, d = self._linear_operands(block, weights.shape[0])
        if d is None:
            return
        dw = torch.tensordot(weights.to(d.dtype), d, 1)  # [N, o]
        ids = {id(p) for p in block.params}
        if id(mod.weight) in ids:
            _add_grad(mod.weight, dw.T @ x, fresh=True)
        if mod.bias is not None and id(mod.bias) in ids:
            _add_grad(mod.bias, dw.sum(dim=0), fresh=True)


def _add_grad(p: Tensor, g: Tensor, fresh: bool = False) -> None:
    """``p.grad += g``; a new ``.grad`` is a copy unless ``g`` is a fresh tensor of our own."""
    g = g.to(p.dtype).reshape(p.shape)
    if p.grad is None:
        p.grad = g if fresh and g._base is None and g.dtype == p.dtype else g.clone()
    else:
        p.grad.add_(g)


def _make_hook(ref: weakref.ReferenceType[GramianRecorder], index: int) -> Any:
    def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        recorder = ref()
        if recorder is not None:
            recorder.record(index, args, output)

    return hook
