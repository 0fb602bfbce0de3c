"""``TaskGradBuffer(..., batch_dim=0)``: every sample (or sample × task) an objective.

``backward(losses)`` takes the unreduced losses ``[B]`` or ``[B, K]`` and, from one backward
of ``Σᵢ ℓᵢ`` per task column (K of them; no weight-gradient kernel runs), builds the
per-sample Gramian ``[N, N]`` (``N = B·K``, objective ``(i, k)`` at ``i·K + k``) with
:class:`~gradbalance._per_sample_gramian.PerSampleGramian`. ``apply_(balancer)`` takes the
weights ``w`` of a weighted balancer from it and writes the trunk's ``.grad``,
``∇ Σ wᵢₖ ℓᵢₖ``: from the layers' recorded inputs and output gradients (one product per
parameter, :mod:`._per_sample_update`) when the step has one micro-batch and every trunk
layer is covered, else one backward through the kept graph; the heads get their plain
gradient of ``Σ ℓᵢₖ``. Each layer is contracted inside the first backward (its block of the
Gramian added, its per-sample forms dropped). Micro-batches: each ``backward`` adds its
objectives; from the second on the forms are kept (the first micro-batch's recomputed once,
through its kept graph) and ``apply_`` adds the cross terms between them. The update equals
the matrix route over the same N objectives (each passed as a task); so do its 2-norm row
clipping and ``update_every`` (:mod:`._per_sample_step`). Under a process group each rank
balances its own objectives and the written gradients are averaged. Reference: Quinton &
Rey, "Jacobian Descent for Multi-Objective Optimization" (arXiv:2406.16232), instance-wise
risk minimisation (docs/per_sample.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._amp import poison_, scale_of
from ._checks import LOSSES_WITHOUT_GRAD, as_parameter_list, check_batch_dim, check_int
from ._coverage import (
    Coverage,
    _module_names,
    fire_post_accumulate_hooks,
    hooked_after_accumulation,
)
from ._per_sample_gramian import Parts, PerSampleGramian, Snapshot
from ._per_sample_mixing import mixed_outputs, mixing_error
from ._per_sample_step import (
    PerSampleStep,
    Update,
    check_gramian_clip,
    check_reused_count,
    refreshed_update,
    reused_update,
)
from ._step_inputs import refuse_complex
from ._step_state import GradWatch, StepCounter
from .balancers import balancer_names
from .balancers._base import Balancer
from .balancers._checks import check_balancer
from .clip import __all__ as _clip_names
from .distributed import check_step_agreement, class_name, resolve_process_group
from .modes import ENGINES
from .modes._amortize import WeightCache
from .modes._rollback import GradSnapshot, StateSnapshot
from .stats import StepStats

__all__ = ["PerSampleBuffer"]


def check_per_sample_losses(losses: object) -> Tensor:
    """``[B]`` or ``[B, K]`` unreduced losses on the graph (else ``ValueError`` naming both)."""
    if not isinstance(losses, Tensor) or losses.dim() not in (1, 2) or losses.numel() == 0:
        found = tuple(losses.shape) if isinstance(losses, Tensor) else type(losses).__name__
        raise ValueError(
            f"losses must be the unreduced per-sample losses, shape [B] (each sample an "
            f"objective) or [B, K] (each sample x task), with batch_dim=0; got {found}. "
            f"Compute them with reduction='none' (torch.stack K task columns along dim 1)"
        )
    if not losses.requires_grad:
        raise ValueError(LOSSES_WITHOUT_GRAD)
    return losses


#: Structures of recorded calls remembered as checked unmixed; past it each new one is checked
#: on every step that has it (a model whose calls vary without bound).
MAX_STRUCTURES = 64

class PerSampleBuffer:
    """The per-sample route of :class:`~gradbalance.TaskGradBuffer` (``batch_dim=0``).

    Args:
        shared_params: the trunk's parameters, each held by a module of ``modules``.
        head_params: parameters that get their plain gradient of ``Σ ℓ`` (``+=``).
        modules: the trunk (module or list of modules); hooks record its layers' calls.
        batch_dim: 0, the samples' dimension of every trunk layer's input and of ``losses``.
        update_every: recompute the weights every this many steps; the steps in between
            reuse the last ones (the same number of objectives) with one weighted backward.
        process_group: data parallelism, per rank: each rank balances its own objectives
            and the written gradients are averaged over the ranks (None: the default group
            when torch.distributed is initialised; ``"local"``: off).

    Micro-batches: every ``backward`` before :meth:`apply_` adds its objectives to the step's
    Gramian, cross terms included (its graph, and with more than one micro-batch each layer's
    per-sample forms, are kept until ``apply_``); :meth:`reset` drops the step.

    Example:
        >>> import torch
        >>> from gradbalance import TaskGradBuffer
        >>> from gradbalance.balancers import UPGrad
        >>> _ = torch.manual_seed(0)
        >>> trunk = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
        ...                             torch.nn.Linear(8, 1))
        >>> buf = TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=0)
        >>> x, y = torch.randn(6, 4), torch.randn(6)
        >>> losses = (trunk(x)[:, 0] - y) ** 2             # [B], reduction='none'
        >>> buf.backward(losses)
        >>> stats = buf.apply_(UPGrad())
        >>> stats.weights.shape, stats.mode
        (torch.Size([6]), 'per_sample')
    """

    def __init__(self, shared_params: Iterable[Tensor], head_params: Iterable[Tensor] | None
                 = None, *, modules: Any = None, batch_dim: int = 0, update_every: int = 1,
                 process_group: Any = None, unsupported: dict[str, bool] | None = None) -> None:
        given = [name for name, set_ in (unsupported or {}).items() if set_]
        if given:
            raise ValueError(
                f"{given} are not available with batch_dim=0 (each sample an objective); "
                f"leave them at their defaults, or use TaskGradBuffer without batch_dim "
                f"(docs/per_sample.md)"
            )
        check_batch_dim(batch_dim)
        if modules is None:
            raise ValueError(
                "batch_dim=0 needs modules=...: the module(s) owning shared_params, e.g. "
                "TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=0)"
            )
        self._cache = WeightCache(update_every)
        resolve_process_group(process_group)  # an invalid value raises here, not later
        self.process_group = process_group
        self.shared = as_parameter_list("shared_params", shared_params)
        self.head_params = as_parameter_list("head_params", head_params, allow_empty=True)
        names = _module_names(modules)
        refuse_complex("shared_params", self.shared, names)
        refuse_complex("head_params", self.head_params, names)
        self._coverage = Coverage(self.shared, self.head_params, "raise", modules,
                                  sum_offered=False)
        self.gramian = PerSampleGramian(modules, self.shared)
        self._losses: list[Tensor] = []  # the step's micro-batches, graphs kept
        self._parts: list[Parts] = []
        self._first: Snapshot = []  # the first micro-batch's records, for the cross terms
        self._heads: list[Tensor | None] = [None] * len(self.head_params)
        self._scaler: Any = None
        self._scale: Tensor | None = None
        self._tasks = 0  # the step's K (task columns of every micro-batch)
        self._reused = False  # the step reuses update_every's cached weights
        self._unmixed: set[tuple[tuple[int, ...], int]] = set()  # structures checked unmixed
        self._steps = StepCounter()  # steps begun; apply_ compares it across the ranks
        self._heads_before: GradSnapshot | None = None  # the heads' .grad before the step
        self._heads_written = False  # the step's head gradients are in .grad (one process)
        self._watch = GradWatch()  # the heads' .grad as the step's last call left them
        self._trainable: tuple[bool, ...] = ()  # the trunk's requires_grad at the step's start

    def backward(self, losses: Tensor | Sequence[Tensor], scaler: Any = None,
                 features: Tensor | None = None) -> None:
        """Add this micro-batch's objectives, ``losses`` ``[B]`` or ``[B, K]``; their block
        joins the step's Gramian (cross terms with the earlier micro-batches included: a
        second call recomputes the first one's layer forms once), and their graph is kept
        until :meth:`apply_`. With a ``GradScaler`` (the same one to
        every call and to :meth:`apply_`) the scaled losses are differentiated. On a step
        that reuses ``update_every``'s weights no Gramian is formed."""
        vector = self._checked(losses, scaler, features)
        columns = vector.reshape(vector.shape[0], -1)
        first = not self._losses
        reused = self._cache.reuse_now() if first else self._reused
        scale = scale_of(scaler, vector.device)
        part, heads, records = self._micro_batch(vector, columns, scale, reused, first)
        if records is not None:
            self._first = records
        if part is not None:
            self._parts.append(part)
        self._losses.append(vector)
        self._heads = [_add(h, g) for h, g in zip(self._heads, heads)]
        self._scaler, self._scale = scaler, scale
        self._tasks, self._reused = columns.shape[1], reused
        if first:
            self._trainable = tuple(p.requires_grad for p in self.shared)
        self._write_heads(heads, first)

    def _write_heads(self, heads: list[Tensor | None], first: bool) -> None:
        """This micro-batch's head gradients into ``.grad`` as a plain backward adds them (one
        process; under a process group :meth:`apply_` writes the ranks' mean); the heads'
        ``.grad`` watched until the step's next call (a ``zero_grad()`` between them is
        refused, as on the task route). Their post-accumulate-grad hooks run in
        :meth:`apply_`, once per step, as the trunk's: its weighted backward reads the
        heads' weights again, which a hook stepping them in place would have changed."""
        if resolve_process_group(self.process_group) is None:
            if first:
                self._heads_before = GradSnapshot(self.head_params)
            for p, g in zip(self.head_params, heads):
                if g is not None:
                    _accumulate(p, g)  # a copy: the step's sum keeps its own
            self._heads_written = True
        self._watch.record(self.head_params)

    def _name_of(self, param: Tensor) -> str:
        """A watched head's name in an error."""
        return next(f"head_params[{i}]" for i, p in enumerate(self.head_params) if p is param)

    def _micro_batch(self, vector: Tensor, columns: Tensor, scale: Tensor | None,
                     reused: bool, first: bool
                     ) -> tuple[Parts | None, list[Tensor | None], Snapshot | None]:
        """The passes of :meth:`backward` past its checks: ``(part, heads, records)``. The
        mixing test refuses as a check (the forward's records dropped, the step kept); any
        failure after it drops the step, torch's generator as the call found it (a hook may
        have drawn)."""
        generator = torch.default_generator.get_state()
        begun = [False]  # a first micro-batch past the checks begins the step (StepCounter)
        try:
            refused = None if reused else self._mixing(vector, scale)
            if refused is None:
                self._begin(first, begun)
                try:
                    part, heads = self._passes(columns, scale, reused, keep=not first)
                    records = self.gramian.snapshot() if first and part is not None else None
                finally:
                    self.gramian.clear()
                if part is not None and len(self._parts) == 1 and self._parts[0].forms is None:
                    self._parts[0], self._first = self._first_forms(), []
        except BaseException:  # past the checks: the step dropped (docs/loop.md)
            torch.default_generator.set_state(generator)
            self._begin(first, begun)  # failed inside the mixing test: begun all the same
            self._drop_step()
            raise
        if refused is not None:
            self.gramian.clear()
            raise refused
        return part, heads, records

    def _begin(self, first: bool, begun: list[bool]) -> None:
        """Count the step as begun (:class:`~._step_state.StepCounter`) at a first
        micro-batch, once."""
        if first and not begun[0]:
            self._steps.begin()
            begun[0] = True

    def _checked(self, losses: Any, scaler: Any, features: Tensor | None) -> Tensor:
        """Every check of :meth:`backward`: the arguments (fix the call and repeat it with
        the same forward), then the graph (the forward's records dropped if it fails)."""
        if features is not None:
            raise ValueError("features= is for mode='features'; with batch_dim=0 pass only "
                             "the per-sample losses")
        vector = check_per_sample_losses(losses)
        tasks = 1 if vector.dim() == 1 else vector.shape[1]
        if self._losses and scaler is not self._scaler:
            raise ValueError(
                "scaler differs from the one given to the earlier backward() of this step; "
                "pass the same GradScaler (or None) to every backward() and to apply_()"
            )
        if self._losses and tasks != self._tasks:
            raise ValueError(
                f"losses has {tasks} task column(s) but the earlier backward() of this step "
                f"had {self._tasks}; every micro-batch of a step has the same K"
            )
        if self._losses:
            self._watch.check("backward", len(self._losses), self._name_of)
        self._check_trainable()
        try:
            self._coverage.check(vector)
        except ValueError:
            self.gramian.clear()
            raise
        self.gramian.check(vector)
        return vector

    def _check_trainable(self) -> None:
        """Raise before anything moves where a head was frozen since the buffer was built, or
        a trunk parameter frozen or unfrozen since the step's first ``backward``
        (between steps it may: the step's Gramian is of one set of parameters); the
        forward's records dropped."""
        try:
            frozen = [i for i, p in enumerate(self.head_params) if not p.requires_grad]
            if frozen:
                raise ValueError(
                    f"head_params[{frozen[0]}] (shape {tuple(self.head_params[frozen[0]].shape)}) "
                    f"no longer requires grad (frozen after the TaskGradBuffer was built); "
                    f"build a new buffer over the trainable parameters, e.g. [p for p in "
                    f"params if p.requires_grad]"
                )
            now = tuple(p.requires_grad for p in self.shared)
            if self._losses and now != self._trainable:
                i = next(i for i, (a, b) in enumerate(zip(now, self._trainable)) if a != b)
                raise ValueError(
                    f"shared_params[{i}] (shape {tuple(self.shared[i].shape)}) "
                    f"{'began' if now[i] else 'stopped'} requiring grad since the first "
                    f"backward() of this step: the step's per-sample Gramian is of one set of "
                    f"parameters; freeze or unfreeze between steps (after apply_), or call "
                    f"buf.reset() to drop the step, then run this forward again"
                )
        except ValueError:
            self.gramian.clear()
            raise

    def _mixing(self, vector: Tensor, scale: Tensor | None) -> ValueError | None:
        """The refusal (``ValueError``) of a trunk that mixes the samples after a recorded
        layer (:mod:`gradbalance._per_sample_mixing`), None where it does not: checked once
        per structure of recorded calls, number of task columns and batch size, ``1 +
        ⌈log₂ B⌉`` extra gradient passes then (a failure inside them raises)."""
        structure = (self.gramian.calls(), *vector.reshape(vector.shape[0], -1).shape)
        if structure in self._unmixed:
            return None
        mixing = mixed_outputs(vector, scale, self.gramian.named_outputs())
        if mixing:
            return mixing_error(mixing, "use batch_dim=None")
        if mixing is not None and len(self._unmixed) < MAX_STRUCTURES:
            self._unmixed.add(structure)
        return None

    def _first_forms(self) -> Parts:
        """The first micro-batch's layer forms, which a second micro-batch's cross terms
        need: its output gradients once more, through its kept graph and recorded calls."""
        vector = self._losses[0]
        columns = vector.reshape(vector.shape[0], -1)
        with self.gramian.restored(self._first):
            outputs = self.gramian.outputs()
            tasks: list[list[Tensor | None]] = []
            for k in range(columns.shape[1]):
                root = columns[:, k].sum()
                tasks.append(list(torch.autograd.grad(
                    root if self._scale is None else root * self._scale, outputs,
                    retain_graph=True, allow_unused=True)))
            return self.gramian.collect(columns.shape[0], tasks, keep=True)

    def _passes(self, columns: Tensor, scale: Tensor | None, reused: bool,
                keep: bool) -> tuple[Parts | None, list[Tensor | None]]:
        """One ``autograd.grad`` per task column: the layers' output gradients (the
        micro-batch's rows; its forms kept if ``keep``) and the heads' gradients; the heads'
        only on a reused step."""
        heads: list[Tensor | None] = [None] * len(self.head_params)
        if reused and not self.head_params:
            return None, heads
        roots = [columns[:, k].sum() for k in range(columns.shape[1])]
        roots = [sum(roots[1:], roots[0])] if reused else roots
        roots = roots if scale is None else [root * scale for root in roots]
        found: list[list[Tensor | None]]
        if reused:
            found = [list(torch.autograd.grad(roots[0], self.head_params, retain_graph=True,
                                              allow_unused=True))]
            part = None
        else:
            part, found = self.gramian.passes(columns.shape[0], roots, self.head_params, keep)
        for grads in found:
            heads = [_add(h, g) for h, g in zip(heads, grads)]
        return part, heads

    def apply_(self, balancer: Balancer, scaler: Any = None, clip: Any = None) -> StepStats:
        """Weights from the Gramian of the step's objectives (``D G D`` with a row clipper's
        factors ``D``), the trunk's ``.grad`` from the layers' operands (one micro-batch,
        every trunk layer covered) or one weighted backward per micro-batch; the heads'
        plain gradients. A reused step (``update_every``) takes the cached
        weights; under a process group the written gradients are the ranks' mean.

        With a scaler the Gramian is unscaled (``/ s²``) before the balancer and the update
        written scaled (``s·g``), as ``scaler.scale(loss).backward()`` would; a non-finite
        step sets ``StepStats.found_inf``, leaves the balancer's and the clipper's state and
        makes every ``.grad`` of the step non-finite so that ``scaler.step`` skips it.
        Without one it raises ``NonFiniteGradientError`` and nothing moves."""
        group = self._check_apply(balancer, scaler, clip)
        saved = StateSnapshot(balancer, clip)
        try:
            if self._reused:
                update = reused_update(self._step(), self._cache, balancer, group)
            else:
                update = refreshed_update(self._step(), self.gramian.gramian(self._parts),
                                          balancer, clip, group)
        except BaseException:
            saved.restore()
            self._drop_step()
            raise
        if update.finite:
            self._commit(update, balancer, saved)
        else:
            saved.restore()
            self._skip(update.heads)
        self._steps.finished()
        return update.stats

    def _unwritten(self, heads: list[Tensor | None]) -> list[Tensor | None]:
        """The head gradients :meth:`apply_` still writes: none where each ``backward`` wrote
        them (one process)."""
        return [None] * len(heads) if self._heads_written else heads

    def _commit(self, update: Update, balancer: Balancer, saved: StateSnapshot) -> None:
        """A finite step's ``.grad`` written and its post-accumulate-grad hooks run (the
        heads' too, where ``backward`` wrote their ``.grad``); a hook that raises drops the
        step, every ``.grad`` and state back as before it."""
        written = [p for p, g in [*zip(self.shared, update.trunk),
                                  *zip(self.head_params, update.heads)] if g is not None]
        hooks, mark = _Hooks(written, self._heads_before), self._cache.mark()
        self._write(update.trunk, self._unwritten(update.heads), update.owned)
        if self._reused:
            self._cache.reused(balancer)
        else:
            self._cache.refreshed(update.stats.weights, balancer)
        try:
            hooks.run()
        except BaseException:  # the step dropped, as on the task route
            self._cache.rewind(mark)
            saved.restore()
            raise

    def _step(self) -> PerSampleStep:
        """The step; with one micro-batch whose layers' operands were kept, its update
        comes from them (:meth:`PerSampleGramian.weighted_update`), not a second backward."""
        direct = None
        if len(self._parts) == 1 and self._parts[0].operands is not None:
            direct = partial(self.gramian.weighted_update, self._parts[0])
        return PerSampleStep(self._losses, self._heads, self.shared, self.head_params,
                             self._scale, self._tasks, direct)

    def _check_apply(self, balancer: Balancer, scaler: Any, clip: Any) -> Any:
        """Every check of :meth:`apply_` (nothing moves if one raises); the process group
        (resolved), whose ranks agree on the step."""
        if not self._losses:
            raise RuntimeError("apply_() called before backward(); call buf.backward(losses)")
        self._watch.check("apply_", len(self._losses), self._name_of)
        check_balancer("balancer", balancer)
        if not balancer.from_gramian:
            raise TypeError(
                f"{type(balancer).__name__} needs the per-sample gradient rows, not only their "
                f"Gramian; with batch_dim=0 use a weighted balancer (UPGrad, MGDA, IMTL-G, "
                f"Nash-MTL, Mean...), or pass each sample's loss as a task: TaskGradBuffer "
                f"without batch_dim, mode='matrix'"
            )
        if scaler is not self._scaler:
            raise ValueError(
                "scaler differs from the one given to backward(); pass the same GradScaler "
                "(or None) to backward() and apply_()"
            )
        check_gramian_clip(clip)
        if self._reused:
            self._cache.check_balancer(balancer)
            check_reused_count(self._cache, sum(v.numel() for v in self._losses))
        group = resolve_process_group(self.process_group)
        if group is not None:  # every rank runs the same kind of step: checked first
            check_step_agreement(group, num_tasks=self._tasks, shared=self.shared,
                                 heads=self.head_params, mode="per_sample",
                                 update_every=self._cache.update_every, step=self._steps.count,
                                 count=len(self._losses), reused=self._reused,
                                 modes=("per_sample", *ENGINES, *balancer_names(),
                                        *_clip_names),
                                 balancer=type(balancer).__name__,
                                 clip=class_name(clip),
                                 scaled=self._scale is not None)
        return group

    def _write(self, trunk: Sequence[Tensor | None], heads: list[Tensor | None],
               owned: bool = False) -> None:
        """The trunk's update and the heads' gradients into ``.grad`` (None: left alone;
        ``owned``: the trunk's tensors are the step's own, taken without a copy where their
        layout is the parameter's); the step ends."""
        for p, g in zip(self.shared, trunk):
            if g is not None:
                _accumulate(p, g, owned)
        for p, h in zip(self.head_params, heads):
            if h is not None:
                _accumulate(p, h)
        self._end_step()

    def _skip(self, heads: list[Tensor | None]) -> None:
        """A skipped step under a scaler: every ``.grad`` it wrote or would write made
        non-finite, then their post-accumulate-grad hooks (as a plain backward runs them,
        overflow or not); a hook that raises drops the step, every ``.grad`` back."""
        written = [*self.shared, *(p for p, h in zip(self.head_params, heads) if h is not None)]
        hooks = _Hooks(written, self._heads_before)
        self._write([torch.zeros_like(p) for p in self.shared], self._unwritten(heads),
                    owned=True)
        poison_([p.grad for p in written if p.grad is not None])
        hooks.run()

    @property
    def in_step(self) -> bool:
        """Whether a step is in progress (a ``backward`` since the last ``apply_``)."""
        return bool(self._losses)

    def state_dict(self) -> dict[str, Any]:
        """``update_every``'s counter and cached weights (with ``update_every > 1``) and
        ``steps_begun`` (the data-parallel ranks compare it in ``apply_``; a step in progress
        is not counted: a run resumed from it repeats that step whole)."""
        steps = {"steps_begun": self._steps.count - int(bool(self._losses))}
        if not self._cache.active:
            return steps
        rank = self._rank()  # the cached weights are this rank's objectives'
        ranks = {} if rank is None else {"rank": rank[0], "world_size": rank[1]}
        return {**self._cache.state_dict(), **steps, **ranks}

    def _rank(self) -> tuple[int, int] | None:
        """``(rank, world size)`` under a process group of several ranks, else None."""
        group = resolve_process_group(self.process_group)
        if group is None or dist.get_world_size(group) < 2:
            return None
        return dist.get_rank(group), dist.get_world_size(group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (checked whole before anything changes; a state
        saved without ``steps_begun`` resumes it at 0)."""
        state = dict(state_dict)
        unknown = sorted(set(state) - {"update_every", "step", "weights", "steps_begun", "rank",
                                       "world_size"})
        if unknown:
            raise ValueError(
                f"state_dict has keys {unknown}, but a batch_dim=0 buffer keeps no state "
                f"but update_every's ('update_every', 'step', 'weights') and 'steps_begun': "
                f"pass the state_dict() of a batch_dim=0 buffer"
            )
        steps = check_int("state_dict['steps_begun']", state.pop("steps_begun", 0), 0)
        saved = (state.pop("rank", None), state.pop("world_size", None))
        here = self._rank() or (None, None)
        if self._cache.active and saved != here:
            raise ValueError(
                f"state_dict holds update_every's cached weights of rank {saved[0]} of "
                f"{saved[1]} (None: one process), but this buffer is rank {here[0]} of "
                f"{here[1]}: each rank caches the weights of its own samples, so save and load "
                f"each rank's own buffer state (a checkpoint file per rank)")
        if state or self._cache.active:  # update_every's state: all three keys, or refused
            self._cache.load_state_dict(state, None)
        self._steps.load(steps)

    def reset(self, keep_weights: bool = False) -> None:
        """Drop the step (the records and the pending Gramian; the heads' ``.grad`` back as
        before its first ``backward``); then ``update_every``'s cached weights too, unless
        ``keep_weights``."""
        self._drop_step()
        self._steps.reset()
        if not keep_weights:
            self._cache.reset()

    def _drop_step(self) -> None:
        """A dropped step: the heads' ``.grad`` back as before its first ``backward``."""
        if self._heads_before is not None:
            self._heads_before.restore()
        self._end_step()

    def _end_step(self) -> None:
        self._heads_before, self._heads_written, self._trainable = None, False, ()
        self._watch.clear()
        self._losses = []
        self._parts = []
        self._first = []
        self._heads = [None] * len(self.head_params)
        self._scaler, self._scale = None, None
        self._tasks, self._reused = 0, False
        self.gramian.clear()


class _Hooks:
    """The post-accumulate-grad hooks of the parameters ``apply_`` writes, run after the
    write (:meth:`run`); where one raises, every ``.grad`` goes back as before the write and
    the heads' as before the step (``heads_before``), then the error is raised."""

    def __init__(self, written: list[Tensor], heads_before: GradSnapshot | None) -> None:
        self.written, self.heads_before = written, heads_before
        self.before = GradSnapshot(written) if hooked_after_accumulation(written) else None

    def run(self) -> None:
        if self.before is None:  # no hook: nothing to run or put back
            return
        try:
            fire_post_accumulate_hooks(self.written, {id(p) for p in self.written})
        except BaseException:
            self.before.restore()
            if self.heads_before is not None:
                self.heads_before.restore()
            raise


def _add(total: Tensor | None, part: Tensor | None) -> Tensor | None:
    if part is None:
        return total
    return part if total is None else total + part


def _accumulate(p: Tensor, g: Tensor, owned: bool = False) -> None:
    """``.grad = g`` where there was none (``g`` itself where ``owned`` and its layout is the
    parameter's, with a storage of its own size; else a copy), ``.grad += g`` elsewhere."""
    if p.grad is None:
        p.grad = g.detach() if owned and _takeable(p, g) else g.detach().clone()
    elif p.grad.layout != torch.strided and g.layout == torch.strided:
        p.grad = g.detach() + p.grad  # a sparse .grad left by a plain backward: now dense
    else:
        p.grad.add_(g)


def _takeable(p: Tensor, g: Tensor) -> bool:
    """Whether ``g`` can be ``p``'s ``.grad`` as it is: dense, the parameter's dtype, device,
    shape and strides, and no storage beyond its own elements."""
    return (g.layout == torch.strided and g.dtype == p.dtype and g.device == p.device
            and g.shape == p.shape and g.stride() == p.stride()
            and g.untyped_storage().nbytes() == g.numel() * g.element_size())
