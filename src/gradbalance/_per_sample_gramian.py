"""The per-sample Gramian ``G_ij = ⟨∇θ ℓᵢ, ∇θ ℓⱼ⟩`` ``[B, B]`` from one backward of ``Σᵢ ℓᵢ``.

When the trunk treats its samples independently, the backward of ``Σᵢ ℓᵢ`` gives every
sample's output gradient ``Dᵢ`` at every layer. A layer of linear form (``nn.Linear`` on 2-D
or 3-D inputs, ``nn.Conv1d``/``nn.Conv2d``, ``nn.Embedding``, ``nn.LayerNorm``, their
biases) has per-sample weight gradients ``Dᵢᵀ Xᵢ`` (inputs or patches ``Xᵢ`` ``[S, in]``), so

    G_ij = Σ_layers Σ_{s,t} (Xᵢₛ·Xⱼₜ)(Dᵢₛ·Dⱼₜ)          (the ghost-norm identity, i ≠ j too)

or ``⟨Dᵢᵀ Xᵢ, Dⱼᵀ Xⱼ⟩`` from the materialised per-sample gradients, per parameter whichever
costs less (Goodfellow 2015; Li et al. 2022; Quinton & Rey 2024, "Jacobian Descent for
Multi-Objective Optimization", §6). The forms are those of :class:`~gradbalance.clip.GhostNorms`
(:mod:`gradbalance.clip._per_sample_layers`, :mod:`gradbalance.clip._per_sample_tied`), tied
weights included. Any other module holding trunk parameters falls back to per-sample
gradients through ``torch.func`` (:mod:`._per_sample_fallback`). Layers that mix the samples
(BatchNorm or SyncBatchNorm in training mode) are refused (docs/per_sample.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrize import is_parametrized

from ._checks import module_list
from ._per_sample_eager import Recorded, Slots, Snapshot, edge_of, lowest
from ._per_sample_fallback import per_sample_grads
from ._per_sample_forms import Form, block, layer_form, summed_blocks
from ._per_sample_update import CONVOLUTIONS, LayerOperands, combined_grads, conv_sum, site_sum
from .clip._per_sample_layers import HookedLayer, refusal, refuse_training_batch_norm
from .clip._per_sample_record import Fallback, LayerRecorder

__all__ = ["Parts", "PerSampleGramian", "Snapshot", "as_modules", "refuse_mixing"]


@dataclass(frozen=True)
class Parts:
    """One micro-batch's objectives: their number, their own block of the Gramian,
    (kept for the cross terms of micro-batches, else None) each trunk parameter's per-sample
    gradient forms (:mod:`._per_sample_forms`), one per site or fallback module, and (kept
    for the weighted update where every trunk layer is recorded, else None) each layer's
    operands (:mod:`._per_sample_update`)."""

    n: int
    gram: Tensor
    forms: dict[int, list[Form]] | None
    operands: list[LayerOperands] | None = None


def as_modules(modules: Any) -> list[tuple[str, nn.Module]]:
    """``modules`` (one module or an iterable of them) as ``(prefix, module)`` pairs."""
    if isinstance(modules, nn.Module):
        return [("", modules)]
    found = module_list(modules)
    return [(f"{i}", m) for i, m in enumerate(found)] if len(found) > 1 else [("", found[0])]


def refuse_mixing(roots: list[tuple[str, nn.Module]]) -> None:
    """Raise ``ValueError`` naming the first layer of the trunk (:func:`as_modules`) that
    mixes the samples: BatchNorm or SyncBatchNorm in training mode."""
    refuse_training_batch_norm(roots, ", or use batch_dim=None")


#: Modules whose forward reads the parameters of their submodules itself rather than calling
#: them (``nn.MultiheadAttention``'s ``out_proj``): one fallback for the whole module. A
#: parametrized module (``torch.nn.utils.parametrizations.weight_norm``, ...) is one too: its
#: weight is computed from the parameters below it whenever its forward reads it.
WHOLE_MODULES: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


#: Modules that only hold parameters (their forward is not defined): the module holding one
#: reads them in its own forward, so their parameters are that module's, for its fallback.
PARAMETER_CONTAINERS: tuple[type[nn.Module], ...] = (nn.ParameterList, nn.ParameterDict)


def _own_parameters(sub: nn.Module, whole: bool) -> list[tuple[str, Tensor]]:
    """``sub``'s parameters by name below it: all of them for a whole-module fallback, else
    its own and those of its :data:`PARAMETER_CONTAINERS` children."""
    if whole:
        return list(sub.named_parameters())
    own: list[tuple[str, Tensor]] = list(sub.named_parameters(recurse=False))
    for child_name, child in sub.named_children():
        if isinstance(child, PARAMETER_CONTAINERS):
            own += [(f"{child_name}.{n}", p) for n, p in child.named_parameters()]
    return own


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


class PerSampleGramian:
    """Forward hooks on the trunk's parameter-holding modules; the per-sample Gramian.

    ``modules``: the trunk (a module or a list); ``params``: the trunk parameters, each held
    by a module in it. Build it before the forward; :meth:`compute` consumes the records.
    """

    def __init__(self, modules: Any, params: list[Tensor]) -> None:
        self._roots = as_modules(modules)
        self.params = params
        self._record = LayerRecorder("the buffer")
        self._layers, self._fallbacks = self._record.layers, self._record.fallbacks
        self._sites, self._dense = self._record.sites, self._record.dense
        wanted = {id(p): p for p in params}
        whole: set[int] = set()  # modules inside a whole-module fallback
        for prefix, root in self._roots:
            for name, sub in root.named_modules():
                if id(sub) not in whole:
                    self._hook(_joined(prefix, name), sub, wanted, whole)
        missing = [i for i in wanted if i not in self._record.names]
        if missing:
            self.remove()
            raise ValueError(
                f"{len(missing)} shared parameter(s) (shapes "
                f"{[tuple(wanted[i].shape) for i in missing]}) are held by no module of "
                f"modules; pass modules= the module(s) owning every shared parameter"
            )

    def _hook(self, name: str, sub: nn.Module, wanted: dict[int, Tensor],
              whole: set[int]) -> None:
        """Hook ``sub`` for its own wanted parameters: a covered layer, or a fallback; a
        module of :data:`WHOLE_MODULES` is one fallback for every parameter below it (added
        to ``whole``)."""
        if isinstance(sub, PARAMETER_CONTAINERS):
            return  # never called: its parameters belong to the module holding it
        inside = isinstance(sub, WHOLE_MODULES) or is_parametrized(sub)
        if inside:
            whole.update(id(m) for m in sub.modules())
        own = [(pname, p) for pname, p in _own_parameters(sub, inside) if id(p) in wanted]
        if not own:
            return
        if not inside and refusal(sub) is None:
            self._record.add_layer(name, sub, wanted)
        else:
            self._record.add_fallback(name, sub, own)

    def check(self, losses: Tensor) -> None:
        """Refuse (``ValueError``/``RuntimeError``, records dropped) what would make the
        Gramian wrong: sample-mixing layers, wrong batch sizes, unrecorded uses."""
        try:
            refuse_mixing(self._roots)
            self._record.check(losses, self.params, "the losses must keep it too (no slice "
                               "or reduction over the batch)", "use batch_dim=None")
        except (ValueError, RuntimeError):
            self.clear()
            raise

    # -- the Gramian --------------------------------------------------------------------
    def outputs(self) -> list[Any]:
        """Every recorded output, layers first, in order (gradient edges once
        :meth:`restored` from a :meth:`snapshot`)."""
        return [edge_of(y) for r in self._record.records() for y in r.outputs]

    def compute(self, batch: int, tasks: Sequence[Sequence[Tensor | None]]) -> Tensor:
        """``[B·K, B·K]`` float64 (objective ``(i, k)`` at ``i·K + k``) from each task's
        gradients of :meth:`outputs` (same order; None: unused)."""
        return self.gramian([self.collect(batch, [list(grads) for grads in tasks])])

    def gramian(self, parts: Sequence[Parts]) -> Tensor:
        """The Gramian of every micro-batch's objectives at once (objectives in micro-batch
        order): each micro-batch's own block, and each parameter's blocks between every two
        micro-batches' kept forms (the cross terms; no concatenation)."""
        starts = [sum(part.n for part in parts[:i]) for i in range(len(parts) + 1)]
        gram = torch.zeros(starts[-1], starts[-1], dtype=torch.float64,
                           device=self.params[0].device)
        for i, left in enumerate(parts):
            gram[starts[i]: starts[i + 1], starts[i]: starts[i + 1]] = left.gram
            for j in range(i + 1, len(parts)):
                part = _pair_block(left, parts[j]).to(gram.device)
                gram[starts[i]: starts[i + 1], starts[j]: starts[j + 1]] = part
                gram[starts[j]: starts[j + 1], starts[i]: starts[i + 1]] = part.T
        return gram

    def collect(self, batch: int, tasks: list[list[Tensor | None]], keep: bool = False) -> Parts:
        """One micro-batch's objectives (``(i, k)`` at ``i·K + k``) from each task's gradients
        of :meth:`outputs`: each layer contracted (:func:`~._per_sample_forms.layer_form`)
        and its block of the Gramian added as soon as its rows form, then its forms and
        output gradients dropped (``tasks``' entries set to None) unless ``keep`` (the cross
        terms of micro-batches need them) or its parameter is tied (every site first)."""
        forms: dict[int, list[Form]] = {}
        gram = torch.zeros(batch * len(tasks), batch * len(tasks), dtype=torch.float64,
                           device=self.params[0].device)
        at = 0
        for layer in self._layers:
            n = len(layer.outputs)
            if n:
                grads = [list(task[at: at + n]) for task in tasks]
                _release(tasks, at, n)
                self._contract(layer, grads, batch, gram, forms, keep)
            at += n
        return self._finished(gram, forms, [task[at:] for task in tasks], keep)

    def passes(self, batch: int, roots: list[Tensor], extra: list[Tensor],
               keep: bool = False) -> tuple[Parts, list[list[Tensor | None]]]:
        """One ``autograd.grad`` per root (each task's scaled ``Σᵢ ℓᵢₖ``, objective
        ``(i, k)`` at ``i·K + k``): the micro-batch's :class:`Parts`, each layer contracted
        inside the backward as soon as its output gradients arrive (a tensor hook), and each
        root's gradients of ``extra``. Without ``keep`` and with no fallback module called,
        the layers' operands are kept for :meth:`weighted_update`."""
        forms: dict[int, list[Form]] = {}
        n = batch * len(roots)
        gram = torch.zeros(n, n, dtype=torch.float64, device=self.params[0].device)
        own = [y for layer in self._layers for y in layer.outputs]
        fallen = [y for f in self._fallbacks for y in f.outputs]
        operands: list[LayerOperands] | None = None if keep or fallen else []
        slots, handles = self._hooked(len(roots), partial(
            self._contract, batch=batch, gram=gram, forms=forms, keep=keep, operands=operands))
        asked = [y for y, low in zip(own, lowest(roots, [*own, *fallen])) if low]
        try:
            rest, extras = _root_passes(slots, roots, asked, fallen, extra)
        finally:
            for handle in handles:
                handle.remove()
        return self._finished(gram, forms, rest, keep, operands), extras

    def _hooked(self, tasks: int, contract: Callable[..., None]) -> tuple[list[Slots],
                                                                          list[Any]]:
        """A :class:`Slots` per recorded layer, ``contract(layer, grads)`` once full, and a
        hook on each of its outputs (the handles, to remove)."""
        slots, handles = [], []
        for layer in self._layers:
            if layer.outputs:
                slots.append(Slots(tasks, len(layer.outputs), partial(contract, layer)))
                handles += [y.register_hook(slots[-1].hook(call))  # type: ignore[no-untyped-call]
                            for call, y in enumerate(layer.outputs)]
        return slots, handles

    def _contract(self, layer: HookedLayer, grads: list[list[Tensor | None]], batch: int,
                  gram: Tensor, forms: dict[int, list[Form]], keep: bool,
                  operands: list[LayerOperands] | None = None) -> None:
        """The layer's forms from its output gradients ``[task][call]`` (None: zeros), its
        block added to ``gram`` (or its forms kept, :meth:`_add`); its operands appended
        to ``operands`` (not None)."""
        filled = [_filled(layer.outputs, g) for g in grads]
        grads.clear()
        if operands is not None:
            operands.append(LayerOperands(layer, list(layer.inputs), filled))
        x, d = _layer_rows(layer, layer.inputs, filled, batch)
        for _, p, is_weight in layer.bounded():
            self._add(gram, forms, p, layer_form(layer.module, is_weight, x, d, len(filled)),
                      keep)

    def _finished(self, gram: Tensor, forms: dict[int, list[Form]],
                  fallen: list[list[Tensor | None]], keep: bool,
                  operands: list[LayerOperands] | None = None) -> Parts:
        """The fallback modules' forms from their output gradients ``fallen`` ``[task][·]``,
        the blocks of the forms that waited; the micro-batch's :class:`Parts`."""
        self._record.recording = False  # the fallback's functional calls are not the step's
        try:
            at = 0
            for fallback in self._fallbacks:
                n = len(fallback.outputs)
                self._add_fallback(fallback, [grads[at: at + n] for grads in fallen], forms)
                _release(fallen, at, n)
                at += n
        finally:
            self._record.recording = True
        for waiting in forms.values():  # tied parameters, or every one with keep
            gram += summed_blocks(waiting, []).to(gram.device)
        return Parts(gram.shape[0], gram, forms if keep else None, operands)

    def weighted_update(self, part: Parts, weights: Tensor) -> list[Tensor | None]:
        """Each trunk parameter's ``Σ wᵢₖ ∇ℓᵢₖ`` (``weights`` ``[B·K]``, the loss scale
        included in the kept output gradients) from ``part``'s operands, in place of a
        weighted backward (:mod:`._per_sample_update`); None for a parameter the checked
        losses do not reach."""
        assert part.operands is not None
        total: dict[int, Tensor] = {}
        for op in part.operands:
            module, grads = op.layer.module, combined_grads(op.grads, weights)
            conv = isinstance(module, CONVOLUTIONS)
            rows = None if conv else _layer_rows(op.layer, op.inputs, [grads],
                                                 part.n // len(op.grads))
            for _, p, is_weight in op.layer.bounded():
                grad = (site_sum(module, is_weight, *rows) if rows is not None
                        else conv_sum(module, is_weight, op.inputs, grads))  # type: ignore[arg-type]
                grad = grad.reshape(p.shape).to(p.dtype)  # a new tensor: added to in place
                total[id(p)] = grad if id(p) not in total else total[id(p)].add_(grad)
        reached = self._record.reached
        return [None if id(p) not in reached else total[id(p)] if id(p) in total
                else torch.zeros_like(p) for p in self.params]

    def _add(self, gram: Tensor, forms: dict[int, list[Form]], p: Tensor, form: Form,
             keep: bool) -> None:
        """``form``'s own block into ``gram`` now, or into ``forms`` where it must wait."""
        if keep or len(self._sites.get(id(p), [])) + len(self._dense.get(id(p), [])) > 1:
            forms.setdefault(id(p), []).append(form)
        else:
            gram += block(form, form).to(gram.device)

    def _add_fallback(self, fallback: Fallback, tasks: list[list[Tensor | None]],
                      forms: dict[int, list[Form]]) -> None:
        """The fallback module's per-sample gradients ``[B·K, numel]`` (summed over its
        calls) into ``forms``."""
        dense: list[Tensor] | None = None
        at = 0
        for call in fallback.inputs:
            n = len(call.carried)
            dense = _summed(dense, per_sample_grads(
                fallback.module, fallback.names, call, list(fallback.outputs[at: at + n]),
                [grads[at: at + n] for grads in tasks], fallback.name))
            at += n
        for name, g in zip(fallback.names, dense or []):
            forms.setdefault(id(fallback.module.get_parameter(name)), []).append(g)

    def snapshot(self) -> Snapshot:
        """The current records (inputs, and outputs as gradient edges: no output is kept
        alive), to :meth:`restored` later."""
        return [(list(r.inputs), [Recorded(y) for y in r.outputs]) for r in self._record.records()]

    @contextmanager
    def restored(self, snapshot: Snapshot) -> Iterator[None]:
        """The records of ``snapshot`` in place of the current ones, inside the block."""
        records = self._record.records()
        current = [(r.inputs, r.outputs) for r in records]
        try:
            for r, (inputs, outputs) in zip(records, snapshot):
                r.inputs, r.outputs = list(inputs), cast(list[Tensor], list(outputs))
            yield
        finally:
            for r, (was_in, was_out) in zip(records, current):
                r.inputs, r.outputs = was_in, was_out

    def named_outputs(self) -> list[tuple[str, list[Tensor]]]:
        """Each recorded layer's and fallback module's name and outputs, for the check that
        nothing after them mixes the samples (:mod:`gradbalance._per_sample_mixing`)."""
        return [(r.name, list(r.outputs)) for r in self._record.records()]

    def calls(self) -> tuple[int, ...]:
        """The number of recorded calls of each layer and fallback module: the structure the
        mixing check holds for."""
        return tuple(len(r.outputs) for r in self._record.records())

    def clear(self) -> None:
        """Drop the recorded calls."""
        self._record.clear()

    def remove(self) -> None:
        """Remove the hooks."""
        self._record.remove()


def _pair_block(left: Parts, right: Parts) -> Tensor:
    """``[nₗ, nᵣ]`` float64: Σ over the parameters of the blocks between the two
    micro-batches' kept forms (tied sites: every pair of sites)."""
    assert left.forms is not None and right.forms is not None
    total = torch.zeros(left.n, right.n, dtype=torch.float64)
    for key, forms in left.forms.items():
        other = right.forms.get(key)
        if forms and other:  # a parameter one of them does not reach: a zero block
            total = total + summed_blocks(forms, other).to(total.device)
    return total


def _root_passes(slots: list[Slots], roots: list[Tensor], asked: list[Tensor],
                 fallen: list[Tensor], extra: list[Tensor]
                 ) -> tuple[list[list[Tensor | None]], list[list[Tensor | None]]]:
    """One ``autograd.grad`` per root (the layers' hooks fill ``slots`` on the way): each
    root's gradients of the fallback outputs ``fallen`` and of ``extra``."""
    rest: list[list[Tensor | None]] = []
    extras: list[list[Tensor | None]] = []
    for task, root in enumerate(roots):
        for slot in slots:
            slot.task = task
        grads = torch.autograd.grad(root, [*asked, *fallen, *extra], retain_graph=True,
                                    allow_unused=True)
        rest.append(list(grads[len(asked): len(asked) + len(fallen)]))
        extras.append(list(grads[len(asked) + len(fallen):]))
        del grads
    for slot in slots:  # outputs off some task's graph: zeros there
        slot.finish()
    return rest, extras


def _release(tasks: list[list[Tensor | None]], at: int, n: int) -> None:
    """Drop the gradients ``at: at + n`` of every task (contracted)."""
    for grads in tasks:
        grads[at: at + n] = [None] * n


def _layer_rows(layer: HookedLayer, inputs: list[Tensor], tasks: list[list[Tensor]],
                batch: int) -> tuple[Tensor, Tensor]:
    """A layer's input rows ``[B, S, in]`` (the same for every task) and output gradient
    rows ``[B·K, S, out]`` (every call along S; objective ``(i, k)`` at ``i·K + k``): views
    of the recorded tensors for one call and one task, copies only otherwise."""
    xs = [layer.rows(t, batch) for t in inputs]
    if len(xs) == 1 and len(tasks) == 1:
        return xs[0], layer.output_rows(tasks[0][0], batch)
    d = torch.stack([torch.cat([layer.output_rows(g, batch) for g in grads], 1)
                     for grads in tasks], 1)
    return xs[0] if len(xs) == 1 else torch.cat(xs, 1), d.flatten(0, 1)


def _filled(outputs: Sequence[Tensor | Recorded],
            grads: Sequence[Tensor | None]) -> list[Tensor]:
    return [(torch.zeros(y.shape, dtype=y.dtype, device=y.device) if g is None else g)
            for y, g in zip(outputs, grads)]


def _summed(before: list[Tensor] | None, new: list[Tensor]) -> list[Tensor]:
    return new if before is None else [a + b for a, b in zip(before, new)]
