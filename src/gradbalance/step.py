"""The balanced step: replaces ``sum(losses).backward()`` in the user's loop.

Stages (``docs/loop.md``):

1. ``backward(losses)``: the heads get ``.grad +=`` their plain gradient of ``Σₖ Lₖ``; the
   trunk's per-task gradients are added into a persistent ``[K, P]`` buffer ``G``. Call it
   once per micro-batch.
2. ``apply_(balancer)``: unscale ``G`` by the ``GradScaler`` scale, check it is finite
   (O(K), from the Gramian's diagonal), optionally clip rows, combine once, and add the result
   (re-scaled) into the trunk's ``.grad``. Returns :class:`~gradbalance.StepStats`.

A step is all or nothing: a failed check raises before anything moves; a failure past the
checks drops the step, every ``.grad`` and state as before its first ``backward``
(``docs/loop.md``, "When a step fails").

Both run with autocast disabled on the gradients' device (a loop may call them inside
``torch.autocast``): the gradient arithmetic stays in the gradients' dtype. How each gradient
mode does stages 1 and 2 lives in :mod:`gradbalance.modes`. The optimizer step,
``zero_grad`` and global clipping stay in the user's loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._amp import no_autocast, scale_of
from ._checks import (
    UNDO_OBSERVATION_TAG,
    as_loss_vector,
    as_parameter_list,
    check_batch_dim,
    check_bool,
    check_int,
    check_optional_num_tasks,
    check_parameters_unchanged,
    module_list,
    param_signatures,
)
from ._coverage import (
    Coverage,
    OtherParams,
    PlainGrads,
    _module_names,
    check_other_params,
    fire_post_accumulate_hooks,
    hooked_after_accumulation,
)
from ._per_sample_buffer import PerSampleBuffer, check_per_sample_losses
from ._per_sample_gramian import as_modules, refuse_mixing
from ._recompute import RecomputeGuard, new_graph
from ._sharding import is_sharded
from ._statedict import check_dict
from ._step_inputs import refuse_complex
from ._step_state import GradWatch, StepCounter
from ._threads import StepOwner
from .balancers import balancer_names
from .balancers._base import Balancer
from .balancers._checks import check_balancer, check_balancer_tasks
from .clip import __all__ as _clip_names
from .clip._checks import check_row_clipper
from .clip._protocol import RowClipper
from .distributed import (
    check_mesh_group,
    check_step_agreement,
    class_name,
    combined_mask,
    resolve_process_group,
)
from .modes import ENGINES, Engine, Mode, StepInput, make_engine
from .modes._amortize import ReusedStep, WeightCache
from .modes._engine import check_saved_passes
from .modes._layout import columns_of
from .modes._masked import check_active, check_active_mask, mask_balancer
from .modes._rollback import GradSnapshot, StateSnapshot
from .stats import StepStats, summed_tasks
from .taskgrads import ParamLayout, Passes, TaskRoots, resolve_passes

__all__ = ["TaskGradBuffer", "balanced_backward"]


def _check_shared_and_heads(shared: list[Tensor], heads: list[Tensor]) -> None:
    shared_ids = {id(p) for p in shared}
    for i, p in enumerate(heads):
        if id(p) in shared_ids:
            raise ValueError(
                f"head_params[{i}] (shape {tuple(p.shape)}) is also in shared_params; a "
                f"parameter is either shared (balanced) or a head's (plain gradient)"
            )
    devices = {p.device for p in shared}
    dtypes = {p.dtype for p in shared}
    if len(devices) > 1 or len(dtypes) > 1:
        raise ValueError(
            f"shared_params span devices {sorted(map(str, devices))} and dtypes "
            f"{sorted(map(str, dtypes))}; put the trunk on one device with one dtype"
        )


class TaskGradBuffer:
    """Accumulates per-task gradients of the shared parameters and balances them once.

    Args:
        shared_params: the trunk's parameters (leaf tensors that require grad; each call
            checks that they still do, with the shape, dtype and device they had here).
        head_params: task-specific parameters; they receive their plain gradient of the
            summed losses (the PCGrad paper's rule), accumulated with ``+=``.
        num_tasks: K (a positive int), checked on every call; inferred from the first
            ``backward`` if None.
        passes: ``"auto"``, ``"measure"``, ``"loop"`` or ``"batched"`` (see
            :mod:`gradbalance.taskgrads`): ``"auto"`` takes the loop on CPU and measures both
            on the first step elsewhere; ``"measure"`` measures on any device. In
            ``gramian`` mode, ``"batched"`` also forms each layer's block inside the backward
            (``[K, K]`` plus one layer held; docs/performance.md, "Modes").
        process_group: data parallelism: ``G``, the heads' ``.grad`` and the losses are
            averaged over its ranks in ``apply_`` before balancing (None: the default group
            when torch.distributed is initialised; ``"local"``: off). See
            :mod:`gradbalance.distributed`.
        mode: ``"matrix"`` (default, ``[K, P]``), ``"gramian"`` (``G Gᵀ`` only, weighted
            balancers, needs ``modules``) or ``"features"`` (gradients w.r.t. the trunk's
            output, a different method; pass ``features=`` to :meth:`backward`). See
            :mod:`gradbalance.modes`. ``"auto"``: per batch shape, the faster of ``matrix``
            and ``gramian`` (same update; ``gramian`` only with ``modules`` and a weighted
            balancer), ``StepStats.route`` says which ran.
        update_every: recompute a weighted balancer's weights every this many steps and reuse
            them in between with one backward of ``Σₖ wₖ Lₖ`` (1: every step).
        modules: for ``mode="gramian"`` (and ``"auto"``'s gramian route), the module(s) owning
            ``shared_params`` (the trunk); in any mode, the names that errors give parameters.
        other_params: what a trainable leaf reached by the losses but in neither list gets:
            ``"raise"`` (default) refuses the step before anything moves, naming it; ``"sum"``
            gives it the plain gradient of ``Σₖ Lₖ``, as a head; ``"ignore"`` leaves its
            ``.grad`` as it is, for a caller that fills it itself (docs/loop.md, "Parameter
            coverage").
        batch_dim: ``0``: every sample (``[B]`` losses) or sample × task (``[B, K]``) is an
            objective, balanced through the per-sample Gramian from one backward (needs
            ``modules`` and a weighted balancer; docs/per_sample.md). With it,
            ``update_every`` reuses the last weights between refreshes, ``clip`` takes 2-norm
            row clippers, and under a process group each rank balances its own samples and
            the ranks' updates are averaged. None (default): the K task losses.

    Each ``backward`` walks the losses' graph: a reentrant ``torch.utils.checkpoint`` is
    refused (pass ``use_reentrant=False``), and ``register_post_accumulate_grad_hook`` hooks
    of the trunk's parameters run once ``apply_`` has written their balanced ``.grad``.

    A trunk sharded with FSDP2 (``fully_shard``: ``DTensor`` parameters) takes the same calls:
    each rank keeps its own columns ``[K, P/W]`` of the task gradients, the ranks sum their
    partial Gramians, and every rank writes its shard of the single-process update
    (``mode="matrix"`` or ``"features"``; docs/distributed.md, "Sharded trunks (FSDP2)").

    Example:
        >>> import torch
        >>> from gradbalance import TaskGradBuffer
        >>> from gradbalance.balancers import PCGrad
        >>> _ = torch.manual_seed(0)
        >>> trunk = torch.nn.Linear(4, 3)
        >>> heads = torch.nn.ModuleList([torch.nn.Linear(3, 1) for _ in range(2)])
        >>> opt = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1)
        >>> buf = TaskGradBuffer(trunk.parameters(), head_params=heads.parameters())
        >>> x, y = torch.randn(8, 4), torch.randn(8, 2)
        >>> feats = trunk(x)
        >>> losses = [((head(feats)[:, 0] - y[:, k]) ** 2).mean() for k, head in enumerate(heads)]
        >>> buf.backward(torch.stack(losses))
        >>> stats = buf.apply_(PCGrad())
        >>> stats.losses
        tensor([0.6222, 0.5996])
        >>> stats.cosine[0, 1]  # the two task gradients conflict: PCGrad projects them
        tensor(-0.1909, dtype=torch.float64)
        >>> opt.step()
        >>> opt.zero_grad()
    """

    def __init__(
        self,
        shared_params: Iterable[Tensor],
        head_params: Iterable[Tensor] | None = None,
        *,
        num_tasks: int | None = None,
        passes: Passes = "auto",
        process_group: Any = None,
        mode: Mode = "matrix",
        update_every: int = 1,
        modules: Any = None,
        other_params: OtherParams = "raise",
        batch_dim: int | None = None,
    ) -> None:
        self._recompute = RecomputeGuard()  # a checkpoint's recomputation counted once
        self._per_sample = None if batch_dim is None else PerSampleBuffer(
            shared_params, head_params, modules=modules, batch_dim=batch_dim,
            update_every=update_every, process_group=process_group, unsupported={
                "num_tasks": num_tasks is not None, "passes": passes != "auto",
                "mode": mode != "matrix", "other_params": other_params != "raise"})
        if self._per_sample is not None:  # each sample an objective (docs/per_sample.md)
            return
        shared = as_parameter_list("shared_params", shared_params)
        heads = as_parameter_list("head_params", head_params, allow_empty=True)
        if modules is not None:  # every mode names parameters from them: a wrong type is
            module_list(modules)  # refused here, not silently ignored
        names = _module_names(modules)
        refuse_complex("shared_params", shared, names)
        refuse_complex("head_params", heads, names)
        _check_shared_and_heads(shared, heads)
        self.layout = ParamLayout(shared)
        resolve_passes(passes, self.layout.device)  # an invalid value raises here, not later
        self.head_params = heads
        self.num_tasks = check_optional_num_tasks("num_tasks", num_tasks)
        self._built_num_tasks = self.num_tasks  # a K learned from the losses is state
        self._signatures = param_signatures(shared), param_signatures(heads)
        self.passes: Passes = passes
        if isinstance(process_group, str):
            resolve_process_group(process_group)  # a string other than "local" is refused
        self.process_group = process_group
        self.update_every = update_every
        self._cache = WeightCache(update_every)
        self.sharded = is_sharded(shared)  # a trunk under FSDP2's fully_shard
        check_mesh_group(shared, process_group)  # FSDP2's mesh = the buffer's group
        self._engine: Engine = make_engine(mode, self.layout, heads, passes, modules)
        self._coverage = Coverage(shared, heads, check_other_params(other_params), modules)
        self._losses: Tensor | None = None
        self._count = 0
        self._undos: list[Callable[[], None]] = []  # the step's weighting calls' undos
        self._scaler: Any = None
        self._scale: Tensor | None = None
        self._reused = False
        self._reused_step = ReusedStep(columns_of(self.layout, heads, passes))
        self._heads_before: GradSnapshot | None = None  # the heads' .grad before the step
        self._states_before: StateSnapshot | None = None  # balancer, clipper, during apply_
        self._steps = StepCounter()  # steps begun; apply_ compares it across the ranks
        self._owner = StepOwner()  # one thread per step, no concurrent calls
        self._watch = GradWatch()  # the heads' .grad as the step's last call left them

    @property
    def mode(self) -> str:
        """The gradient mode (``"matrix"``, ``"gramian"``, ``"auto"`` or ``"features"``), its
        engine's; ``"per_sample"`` with ``batch_dim=0``."""
        return "per_sample" if self._per_sample is not None else self._engine.mode

    # -- stage 1 ------------------------------------------------------------------------
    def backward(
        self,
        losses: Tensor | Sequence[Tensor],
        scaler: Any = None,
        *,
        features: Tensor | None = None,
    ) -> None:
        """Add this micro-batch's task gradients into ``G`` and the heads' ``.grad``.

        ``losses`` are the K task losses (batch means; divide by the number of micro-batches
        yourself if you want their average), a list of scalars or a ``torch.stack`` of them
        (elementwise ops after the stack, such as ``/ M``, are fine): each task's pass then
        starts at its own loss and crosses only its own head. With a ``GradScaler``, pass it
        here and to :meth:`apply_`; the scaled losses are backpropagated, as
        ``scaler.scale`` would.
        ``features``: the shared representation the heads read (``mode="features"`` only).
        In ``features`` mode a step takes one ``backward`` (any number on a step that reuses
        cached weights, ``update_every``); ``gramian`` mode keeps each micro-batch's linear-layer
        inputs and output gradients (and the ``[K, P_b]`` rows of other blocks) so that the
        step's Gramian is the full batch's. Called under ``torch.no_grad()``, the passes still
        run with grad enabled. Failures: docs/loop.md, "When a step fails".
        """
        if self._per_sample is not None:  # under torch.no_grad() too, as below
            first = not self._per_sample.in_step
            with torch.enable_grad(), self._recompute.call(new_graph(), first):
                return self._per_sample.backward(losses, scaler, features)
        self._owner.enter("backward")
        try:
            if torch.is_grad_enabled():
                self._backward(losses, scaler, features)
            else:  # called under torch.no_grad(): the losses' graph is there all the same
                with torch.enable_grad():
                    self._backward(losses, scaler, features)
        finally:
            self._owner.exit(self._count > 0)

    def _backward(self, losses: Tensor | Sequence[Tensor], scaler: Any,
                  features: Tensor | None) -> None:
        vector = as_loss_vector("losses", losses, self.num_tasks)
        if self._count > 0 and scaler is not self._scaler:
            raise ValueError(
                "scaler differs from the one given to the earlier backward() of this step; "
                "pass the same GradScaler (or None) to every backward() and to apply_()"
            )
        first = self._count == 0
        reused = self._cache.reuse_now() if first else self._reused
        self._engine.check_backward(features, self._count, reused)
        self._check_parameters()
        if not first:
            self._watch.check("backward", self._count, self._name_of)
        others = self._other_params(vector)
        with no_autocast(self.layout.device):
            scale = scale_of(scaler, vector.device)
            roots = TaskRoots(losses, vector, scale, past_the_stack=not self.sharded)
        if first:
            self._heads_before = GradSnapshot([*self.head_params, *others])
            self._steps.begin()
        generator = torch.default_generator.get_state()  # a hook may draw: put back on failure
        try:
            with no_autocast(self.layout.device), self._recompute.call(roots.graph, first):
                plain = PlainGrads(roots.scaled.sum(), others)
                if reused:
                    assert self._cache.weights is not None
                    self._reused_step.backward(self._cache.weights, roots, self.layout.params,
                                               self.head_params)
                    self._engine.clear()  # this forward's records are not needed
                else:
                    self._engine.backward(roots, first, features)
                plain.accumulate_()  # after the passes, which still read these leaves
        except BaseException:
            torch.default_generator.set_state(generator)
            self._observed(losses)  # the step is dropped with this micro-batch's call too
            self._abort()
            raise
        self._observed(losses)
        if self.num_tasks is None:
            self.num_tasks = vector.shape[0]
        detached = vector.detach()
        self._losses = detached.clone() if first or self._losses is None else (
            self._losses + detached
        )
        self._reused = reused
        self._count += 1
        self._scaler = scaler
        self._scale = scale
        # the .grad holding part of the step until apply_ (the trunk's part is in the buffer)
        self._watch.record([*self.head_params, *others])

    # -- stage 2 ------------------------------------------------------------------------
    def apply_(
        self,
        balancer: Balancer,
        scaler: Any = None,
        clip: RowClipper | None = None,
        active: Tensor | None = None,
    ) -> StepStats:
        """Balance the accumulated task gradients once and add the result into ``.grad``.

        ``balancer``: a :class:`~gradbalance.balancers.Balancer` object, the same one every
        step (a registry name is refused: a balancer built per call would lose its state).
        With a scaler, ``G`` is unscaled first (so norms, clipping and scale-sensitive
        balancers see true gradients) and the result is re-scaled on write-back, so that
        ``scaler.unscale_``, ``clip_grad_norm_`` and ``scaler.step`` work unchanged.

        ``StepStats.found_inf`` is True exactly when the step must be skipped: ``G`` (or,
        with a scaler, a head's ``.grad``) held inf/NaN, or the balanced update overflows
        once re-scaled. The balancer, the clipper and the cached weights then keep their
        state; with a scaler every ``.grad`` of the step is made non-finite so that the
        scaler skips it (and lowers the scale); without one ``NonFiniteGradientError`` is
        raised. Failures: docs/loop.md, "When a step fails".

        ``active`` (a bool ``[K]`` mask): the balancer runs on the active tasks' rows only,
        the others get weight 0 (docs/loop.md, "Partial labels").
        """
        if self._per_sample is not None:
            if active is not None:
                raise ValueError("active= masks tasks, but with batch_dim=0 every sample is an "
                                 "objective: drop the unlabelled samples' losses instead, and "
                                 "pass active=None")
            with torch.enable_grad(), self._recompute.later():  # its weighted backward
                return self._per_sample.apply_(balancer, scaler, clip)
        self._owner.enter("apply_")
        try:
            return self._apply(balancer, scaler, clip, active)
        finally:
            self._owner.exit(self._count > 0)

    def _apply(self, balancer: Balancer, scaler: Any, clip: RowClipper | None,
               active: Tensor | None) -> StepStats:
        if active is not None and self._losses is not None:  # before the ranks' collectives
            active = check_active_mask(active, self._losses.shape[0])
        step = self._checked_step(balancer, scaler, clip, active is not None)
        masked = mask_balancer(balancer, self._active_index(active, step),
                               step.losses.shape[0])
        # a hook that raises drops the step too: the trunk's .grad put back (no copy while
        # None, as for optimizer-in-backward hooks), only where a hook is there to run
        fired = not self.sharded and bool(hooked_after_accumulation(self.layout.params))
        trunk_before = GradSnapshot(self.layout.params) if fired else None
        cache_before = self._cache.mark()
        try:
            with no_autocast(self.layout.device), self._recompute.later():
                if self._reused:
                    stats = self._reused_step.finish(self._cache, step, self.layout.params,
                                                     self.head_params, self.mode, balancer)
                else:
                    stats = self._engine.apply(masked, step)
                    if not stats.found_inf:  # a skipped step leaves the cache and the counter
                        self._cache.refreshed(stats.weights, balancer)
        except BaseException:
            self._abort()
            raise
        if trunk_before is not None:  # FSDP2's passes accumulate .grad, running them itself
            try:
                fire_post_accumulate_hooks(self.layout.params, self._coverage.shared_reached)
            except BaseException:
                trunk_before.restore()
                self._cache.rewind(cache_before)
                self._abort()
                raise
        self._steps.finished()
        self._end_step()
        return stats

    def _active_index(self, active: Tensor | None, step: StepInput) -> Tensor | None:
        """The active tasks' indices (None: all), the ranks' masks OR-ed first (a task with
        labels on any rank's shard is active in the global batch)."""
        if active is not None and step.group is not None:
            active = combined_mask(active, step.group)
        index = check_active(active, step.losses.shape[0])
        if index is not None and self._cache.active:
            raise ValueError(f"active drops tasks, but update_every={self.update_every} reuses "
                             f"weights across steps (applied in backward); pass active=None "
                             f"or use update_every=1")
        return index

    def _checked_step(self, balancer: Balancer, scaler: Any,
                      clip: RowClipper | None, masked: bool = False) -> StepInput:
        """Every check of ``apply_`` (nothing moves if one raises); the engine's input."""
        if self._count == 0 or self._losses is None:
            raise RuntimeError(
                "apply_() called before any backward(); call buf.backward(losses) for each "
                "micro-batch first"
            )
        check_balancer("balancer", balancer)
        if not masked:  # a mask's sub-problem is checked by the masked balancer
            check_balancer_tasks(balancer, self._losses.shape[0])
        check_row_clipper("clip", clip)
        if scaler is not self._scaler:
            raise ValueError(
                "scaler differs from the one given to backward(); pass the same GradScaler "
                "(or None) to backward() and apply_()"
            )
        if self._cache.active and not balancer.from_gramian:
            raise TypeError(
                f"update_every={self.update_every} reuses task weights, but "
                f"{type(balancer).__name__} is not a weighted balancer; use update_every=1"
            )
        if self._reused:
            self._cache.check_balancer(balancer)
        else:
            self._engine.check_apply(balancer, clip)
        self._check_parameters()
        self._watch.check("apply_", self._count, self._name_of)
        group = resolve_process_group(self.process_group)
        if group is not None:  # every rank runs the same step: checked before anything moves
            check_step_agreement(group, num_tasks=self._losses.shape[0],
                                 shared=self.layout.params, heads=self.head_params,
                                 mode=self.mode, update_every=self.update_every,
                                 step=self._steps.count, count=self._count, reused=self._reused,
                                 modes=(*ENGINES, "per_sample", *balancer_names(),
                                        *_clip_names),
                                 balancer=type(balancer).__name__,
                                 masked=masked, clip=class_name(clip),
                                 scaled=self._scale is not None)
        self._states_before = StateSnapshot(balancer, clip)
        return StepInput(self._losses, self._scale, self._count, clip, group,
                         self._states_before)

    def _other_params(self, vector: Tensor) -> list[Tensor]:
        """The coverage check (raises before anything moves); the leaves in neither list
        that get the plain gradient (``other_params="sum"``)."""
        if self.sharded:  # FSDP2's forward reads all-gathered copies: no walk there
            return []
        others = self._coverage.check(vector)
        if others and resolve_process_group(self.process_group) is not None:
            raise ValueError(
                "other_params='sum' is not averaged over data-parallel ranks; list the "
                "parameters in neither list in head_params instead"
            )
        return others

    def _name_of(self, param: Tensor) -> str:
        """A watched parameter's name in an error: ``head_params[i]``, or a leaf given the
        plain gradient by ``other_params="sum"``."""
        for i, p in enumerate(self.head_params):
            if p is param:
                return f"head_params[{i}]"
        return f"'{self._coverage.names.get(id(param), 'a parameter')}' (other_params='sum')"

    def _check_parameters(self) -> None:
        """Raise before anything moves if a parameter was frozen, resized or moved."""
        shared, heads = self._signatures
        check_parameters_unchanged("shared_params", self.layout.params, shared)
        check_parameters_unchanged("head_params", self.head_params, heads)

    def _abort(self) -> None:
        """A call failed: the heads' ``.grad``, the balancer and the clipper back as before
        the step; the step dropped."""
        if self._states_before is not None:
            self._states_before.restore()
        if self._heads_before is not None:
            self._heads_before.restore()
        self._drop_observations()
        self._end_step()

    def _observed(self, losses: object) -> None:
        """Keep the undo of the loss weighting call that made ``losses``, if one did
        (``UNDO_OBSERVATION_TAG``): a dropped step takes its observations back."""
        undo = getattr(losses, UNDO_OBSERVATION_TAG, None)
        if undo is not None:
            self._undos.append(undo)

    def _drop_observations(self) -> None:
        """The loss weightings' observations of the dropped step's micro-batches taken back,
        the last first (the weightings' pending state as before the step): a retried step
        observes its losses once."""
        undos, self._undos = self._undos, []
        for undo in reversed(undos):
            undo()

    def _end_step(self) -> None:
        """The buffer is free for the next step (the losses of this one are dropped)."""
        self._count = 0
        self._losses = None
        self._undos = []
        self._reused = False
        self._heads_before = None
        self._states_before = None
        self._watch.clear()
        self._reused_step.clear()
        self._engine.clear()
        self._coverage.end_step()

    def state_dict(self) -> dict[str, Any]:
        """The ``update_every`` counter, the cached weights, the passes measured or fallen
        back to, ``steps_begun`` (the data-parallel ranks compare it in ``apply_``) and
        ``num_tasks`` (as built, or learned from the first losses). A step
        in progress is transient: its task gradients and its count are not saved, so a run
        resumed from a state saved mid-step repeats that step whole, as one never saved."""
        if self._per_sample is not None:  # update_every's counter and weights only
            return self._per_sample.state_dict()
        return {**self._cache.state_dict(), **self._engine.state_dict(),
                "steps_begun": self._steps.count - int(self._count > 0),
                "num_tasks": self.num_tasks}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; works on a freshly built buffer.

        The cached weights must be ``[K]`` finite numbers, K the buffer's ``num_tasks`` (set
        from them when not known yet); a refused state raises ``ValueError`` before anything
        changes. Refused during a step (``RuntimeError``): its micro-batches so far ran with
        the current weights and counter."""
        _refuse_load_mid_step(self.in_step)
        if self._per_sample is not None:
            return self._per_sample.load_state_dict(state_dict)
        check_dict("TaskGradBuffer", state_dict)
        unknown = sorted(set(map(str, state_dict)) - _BUFFER_KEYS)
        if unknown:
            raise ValueError(f"TaskGradBuffer state_dict has unknown keys {unknown} (expected "
                             f"{sorted(_BUFFER_KEYS)}); pass the output of "
                             f"TaskGradBuffer.state_dict()")
        state = dict(state_dict)
        passes = check_saved_passes(state.pop("passes", None))
        route = state.pop("auto_route", None)  # mode="auto"'s decisions
        tasks = state.pop("gramian_tasks", None)  # the K gramian's forwards plan with
        if tasks is not None:
            check_int("state_dict['gramian_tasks']", tasks, 1)
        steps = check_int("state_dict['steps_begun']", state.pop("steps_begun", 0), 0)
        saved_k = state.pop("num_tasks", None)
        cached = self._cache.checked(state, self.num_tasks)
        k = self._loaded_num_tasks(saved_k, cached[1])
        engine_state: dict[str, Any] = {} if passes is None else {"passes": passes}
        if route is not None:
            engine_state["auto_route"] = route
        if tasks is not None:
            engine_state["gramian_tasks"] = tasks
        self._engine.load_state_dict(engine_state)  # checked whole before it changes anything
        self._cache.put(*cached)
        self.num_tasks = k
        self._steps.load(steps)  # a state saved before the counter existed resumes at 0

    def _loaded_num_tasks(self, saved: Any, weights: Tensor | None) -> int | None:
        """The K a load leaves (a load is a reset to the state): the saved weights', else the
        saved ``num_tasks`` (a K learned from the losses), else the one built with;
        ``ValueError`` where they disagree with each other or with the built one."""
        if saved is None:
            return self._built_num_tasks if weights is None else weights.shape[0]
        check_int("state_dict['num_tasks']", saved, 1)
        if self._built_num_tasks not in (None, saved) or (
                weights is not None and weights.shape[0] != saved):
            raise ValueError(
                f"state_dict['num_tasks'] = {saved} but this buffer was built with num_tasks="
                f"{self._built_num_tasks} (cached weights: "
                f"{None if weights is None else weights.shape[0]} tasks); load a state saved "
                f"by a buffer of the same tasks")
        return int(saved)

    @property
    def layer_routes(self) -> dict[str, str] | None:
        """``mode="gramian"`` (and ``"auto"`` on a ``gramian`` step): the route each trunk
        ``nn.Linear`` or convolution took in the current or last step, by module name,
        ``"activations"`` or ``"rows"`` (docs/performance.md, "gramian"); None in the other
        modes and with ``batch_dim=0``."""
        if self._per_sample is not None:
            return None
        routes: dict[str, str] | None = getattr(self._engine, "layer_routes", None)
        return None if routes is None else dict(routes)

    @property
    def in_step(self) -> bool:
        """Whether a step has begun: a ``backward`` ran (or began) since the last ``apply_``
        or :meth:`reset`."""
        return self._count > 0 if self._per_sample is None else self._per_sample.in_step

    @property
    def matrix(self) -> Tensor | None:
        """The accumulated ``[K, P]`` task gradients (scaled, if a scaler was given), or None;
        on a sharded trunk this rank's columns ``[K, P_local]``; None with ``batch_dim=0``
        (the step keeps the Gramian of the objectives, never their rows)."""
        if self._per_sample is not None:
            return None
        return self._engine.matrix if self._count > 0 else None

    def reset(self, *, keep_weights: bool = False) -> None:
        """Drop the current step: the heads' ``.grad`` back as before its first ``backward``
        (as a failed step leaves them), the trunk's task gradients gone; then the cached
        weights of ``update_every`` too, unless ``keep_weights`` (the recovery from a failed
        forward keeps them: docs/loop.md, "When a step fails"). Keeps the buffer's memory;
        from any thread, not while another thread is inside a call (``RuntimeError``)."""
        check_bool("keep_weights", keep_weights)
        if self._per_sample is not None:
            return self._per_sample.reset(keep_weights)
        self._owner.drop("reset")
        if self._heads_before is not None:
            self._heads_before.restore()
        self._drop_observations()
        self._end_step()
        self._steps.reset()
        if not keep_weights:
            self._cache.reset()


#: The keys of :meth:`TaskGradBuffer.state_dict` (its modes' together).
_BUFFER_KEYS = frozenset({"update_every", "step", "weights", "passes", "auto_route",
                          "gramian_tasks", "steps_begun", "num_tasks"})


def _refuse_load_mid_step(in_step: bool) -> None:
    """``load_state_dict`` between steps only: raise ``RuntimeError`` during one."""
    if in_step:
        raise RuntimeError(
            "load_state_dict() called during a step (after backward(), before apply_()): "
            "the step's micro-batches so far used the buffer's current update_every weights "
            "and counter; finish the step with apply_() or drop it with buf.reset() (or "
            "load into a fresh buffer) first"
        )


def balanced_backward(
    losses: Tensor | Sequence[Tensor],
    balancer: Balancer,
    *,
    shared_params: Iterable[Tensor],
    head_params: Iterable[Tensor] | None = None,
    scaler: Any = None,
    clip: RowClipper | None = None,
    passes: Passes = "auto",
    process_group: Any = None,
    mode: Mode = "matrix",
    features: Tensor | None = None,
    other_params: OtherParams = "raise",
    active: Tensor | None = None,
    modules: Any = None,
    batch_dim: int | None = None,
) -> StepStats:
    """One-shot balanced backward for a single micro-batch.

    Equivalent to ``TaskGradBuffer(...).backward(losses, features=features)`` then
    ``.apply_(balancer, active=active)``, with the same options. For a loop, keep a
    :class:`TaskGradBuffer` instead: it reuses its ``[K, P]`` buffer, keeps ``update_every``'s
    cached weights (a one-shot call has no next step to reuse them in), and in ``gramian`` mode
    registers its forward hooks once (build it before the forward).

    ``batch_dim=0`` (with ``modules=`` the trunk): the update of
    ``TaskGradBuffer(..., batch_dim=0)`` through the rows route, as it runs after the forward
    without layer hooks (docs/per_sample.md).

    Example:
        >>> import torch
        >>> from gradbalance import balanced_backward
        >>> from gradbalance.balancers import PCGrad
        >>> w = torch.zeros(2, requires_grad=True)
        >>> losses = torch.stack([w @ torch.tensor([1.0, 0.0]), w @ torch.tensor([-1.0, 1.0])])
        >>> _ = balanced_backward(losses, PCGrad(), shared_params=[w])
        >>> w.grad  # rows (1, 0), (-1, 1) conflict: each projected off the other, then summed
        tensor([0.5000, 1.5000])
    """
    check_balancer("balancer", balancer)
    if batch_dim is not None:
        return _per_sample_backward(losses, balancer, shared_params, head_params, scaler, clip,
                                    passes, other_params, modules, batch_dim,
                                    {"process_group": resolve_process_group(process_group)
                                     is not None, "mode": mode != "matrix",
                                     "features": features is not None,
                                     "active": active is not None})
    if mode == "gramian":
        raise ValueError(
            "balanced_backward cannot use mode='gramian': its forward hooks must exist before "
            "the forward. Build TaskGradBuffer(..., mode='gramian', modules=model.trunk) once, "
            "before the training loop, and call buf.backward(losses); buf.apply_(balancer)"
        )
    buf = TaskGradBuffer(shared_params, head_params, passes=passes,
                         num_tasks=balancer.num_tasks, process_group=process_group, mode=mode,
                         other_params=other_params)
    buf.backward(losses, scaler=scaler, features=features)
    return _applied_or_reset(buf, balancer, scaler, clip, active)


def _applied_or_reset(buf: TaskGradBuffer, balancer: Balancer, scaler: Any,
                      clip: RowClipper | None, active: Tensor | None = None) -> StepStats:
    """``buf.apply_(...)``; where it raises (a refused ``clip`` or ``active``, a solver
    error), the step is dropped first: the heads' ``.grad`` the backward wrote go back as
    the call found them, so a one-call step that raises has moved nothing."""
    try:
        return buf.apply_(balancer, scaler=scaler, clip=clip, active=active)
    except BaseException:
        buf.reset()
        raise


def _per_sample_backward(losses: Any, balancer: Balancer, shared_params: Iterable[Tensor],
                         head_params: Iterable[Tensor] | None, scaler: Any,
                         clip: RowClipper | None, passes: Passes, other_params: OtherParams,
                         modules: Any, batch_dim: int, given: dict[str, bool]) -> StepStats:
    """``balanced_backward(..., batch_dim=0)``: the objectives as the matrix mode's tasks,
    the statistics those of the per-sample route (``mode="per_sample"``, ``per_task``)."""
    refused = [name for name, set_ in given.items() if set_]
    if refused:
        raise ValueError(
            f"{refused} are not available with balanced_backward(..., batch_dim=0), which "
            f"runs the objectives of one process; leave them at their defaults, or build "
            f"TaskGradBuffer(..., modules=trunk, batch_dim=0) before the forward "
            f"(docs/per_sample.md)"
        )
    check_batch_dim(batch_dim, or_none=True)
    if modules is None:
        raise ValueError("batch_dim=0 needs modules=...: the trunk, whose layers are checked "
                         "for sample-mixing ones (BatchNorm in training mode)")
    refuse_mixing(as_modules(modules))
    vector = check_per_sample_losses(losses)
    buf = TaskGradBuffer(shared_params, head_params, passes=passes, process_group="local",
                         modules=modules, other_params=other_params)
    buf.backward(vector.reshape(-1), scaler=scaler)
    stats = _applied_or_reset(buf, balancer, scaler, clip)
    stats.mode = "per_sample"
    gram = None
    if not stats.found_inf and stats.task_norms is not None and stats.cosine is not None:
        gram = stats.cosine * stats.task_norms[:, None] * stats.task_norms[None, :]
    stats.per_task = summed_tasks(stats, gram, 1 if vector.dim() == 1 else vector.shape[1])
    return stats
