"""Hugging Face ``Trainer`` integration: the balanced step inside ``Trainer.training_step``.

transformers is optional (``pip install gradbalance[transformers]``); importing this module
without it raises an ``ImportError`` naming the extra. The model's forward returns the K task
losses (batch means) under the key ``losses`` of its output (a dict or a ``ModelOutput``; a
``[K]`` tensor or a list of K scalars)::

    trainer = BalancedTrainer(
        model=model, args=TrainingArguments("out", gradient_accumulation_steps=2),
        train_dataset=data,
        balancer=gradbalance.get_balancer("upgrad", num_tasks=3),
        shared_params=lambda m: m.trunk.parameters(),
        head_params=lambda m: m.heads.parameters())
    trainer.train()                                   # or train(resume_from_checkpoint=True)

Only ``training_step`` changes; the Trainer's loop around it (clipping, optimizer, scaler,
logging, checkpoints with ``gradbalance.pt``, evaluation) is kept. What each stage does,
FSDP2, and why DeepSpeed, FSDP1 and ``DataParallel`` are refused: docs/integrations.md,
"Hugging Face ``Trainer``".
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .._optional import require
from ..balancers._base import Balancer
from ..checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from ..clip._protocol import RowClipper
from ..distributed import ddp_no_sync
from ..modes import ENGINES
from ..monitor import task_labels
from ..stats import StepStats
from ..step import TaskGradBuffer
from ..weighting._base import LossWeighting
from ._core import BalancedParts, check_buffer_options
from ._sharded import ALTERNATIVE, fsdp2_sync_on, require_sharded, sharding_refusal

require("transformers", "transformers", "gradbalance.integrations.transformers")
from transformers import Trainer  # noqa: E402 - after the check that names the extra

__all__ = ["RANK_STATE_FILE", "STATE_FILE", "BalancedTrainer", "ParamSource", "task_losses_of"]

#: The file in each checkpoint folder that holds the balanced step's state.
STATE_FILE = "gradbalance.pt"

#: Under FSDP2, the file of each process's state (``RANK_STATE_FILE.format(rank=N)``).
RANK_STATE_FILE = "gradbalance.rank{rank}.pt"

#: Parameters, or a callable that picks them from the (unwrapped) model.
ParamSource = Iterable[Tensor] | Callable[[nn.Module], Iterable[Tensor]]


def task_losses_of(outputs: Any) -> Tensor | Sequence[Tensor]:
    """The K task losses in a model's output: ``outputs["losses"]`` (or ``outputs.losses``).

    Example:
        >>> import torch
        >>> from gradbalance.integrations.transformers import task_losses_of
        >>> task_losses_of({"loss": torch.tensor(3.0), "losses": torch.tensor([1.0, 2.0])})
        tensor([1., 2.])
    """
    losses = None
    if isinstance(outputs, Mapping):
        losses = outputs.get("losses")
    elif hasattr(outputs, "losses"):
        losses = outputs.losses
    if losses is None:
        raise ValueError(
            f"BalancedTrainer expects the model's forward to return the K task losses under "
            f"'losses' (a dict or ModelOutput field holding a [K] tensor or a list of K "
            f"scalars), got a {type(outputs).__name__}"
            + (f" with keys {sorted(outputs)}" if isinstance(outputs, Mapping) else "")
            + "; return them so, or override compute_task_losses(model, inputs)"
        )
    return losses  # type: ignore[no-any-return]


def _materialize(name: str, source: ParamSource | None) -> ParamSource | None:
    """A one-shot iterable (``model.parameters()``) becomes a list now; callables stay."""
    if source is None or callable(source):
        return source
    if isinstance(source, Tensor):
        raise TypeError(f"Invalid {name}: a single tensor (expected an iterable of "
                        f"parameters or a callable model -> parameters)")
    return list(source)


def _resolve(name: str, source: ParamSource | None, model: nn.Module, method: str
             ) -> list[Tensor]:
    if source is None:
        pick = getattr(model, method, None)
        if not callable(pick):
            raise TypeError(
                f"{name} not given and {type(model).__name__} has no {method}(); pass "
                f"{name}=lambda model: model.<part>.parameters()"
            )
        return list(pick())
    return list(source(model) if callable(source) else source)


def _buffer_options(options: Mapping[str, Any], model: nn.Module) -> dict[str, Any]:
    """The buffer's options; the model names the parameters in the core's coverage check
    (docs/loop.md, "Parameter coverage") unless ``modules`` is given or the mode hooks them
    (``gramian``, ``auto``: ``modules`` is the trunk there)."""
    found = dict(options)
    engine = ENGINES.get(found.get("mode", "matrix"))
    if "modules" not in found and engine is not None and not engine.hooks_forward:
        found["modules"] = model
    return found


def _warn_repeated(counted: int, samples: Any, processes: int, batch: int) -> None:
    """Warn where the processes evaluated more samples than the set holds: accelerate's
    loader repeats the first samples to even out the processes' last batches, and the
    model's batch-mean losses cannot leave them out."""
    if isinstance(samples, int) and 0 < samples < counted:
        warnings.warn(
            f"the per-task evaluation losses count {counted - samples} samples twice: the "
            f"data loader repeated them to even out the last batches of {processes} processes "
            f"(the Trainer's eval_loss counts them too); an evaluation set of a multiple of "
            f"{processes} processes x per_device_eval_batch_size={batch} samples gives the "
            f"exact means", RuntimeWarning, stacklevel=3)


class BalancedTrainer(Trainer):
    """A ``transformers.Trainer`` whose backward is the balanced step.

    Args:
        *args: the ``Trainer``'s.
        balancer: any :class:`~gradbalance.Balancer`, the same object for the whole run.
        shared_params: the trunk's parameters, or a callable ``model -> parameters`` (called
            once, on the unwrapped model placed on its device; use one with ``model_init``,
            and under FSDP2, where it is called on the sharded model). Default:
            ``model.shared_parameters()``.
        head_params: the heads' parameters (a plain gradient of ``Σₖ Lₖ``), or a callable.
            Default: ``model.head_parameters()`` if the model has it, else every trainable
            parameter outside ``shared_params``; a trainable parameter the losses reach in
            neither list is refused (docs/loop.md, "Parameter coverage").
        weighting: optional :class:`~gradbalance.LossWeighting` applied to every micro-batch's
            losses. A learnable one needs its parameters in the optimizer
            (``optimizers=(...)``) and in ``head_params`` (the losses reach them); their
            ``.grad`` is cleared at each step's first micro-batch (the Trainer zeroes only
            the model's).
        clip: optional row clipper (e.g. :class:`~gradbalance.TaskClip`).
        buffer_options: more arguments of :class:`~gradbalance.TaskGradBuffer` (``mode``,
            ``passes``, ``update_every``, ``modules``, ``process_group``, ``other_params``).
        log_prefix: prefix of the logged scalars.
        task_names: the tasks' names in the logged scalars (``balance/loss/depth``) and the
            per-task evaluation losses; default ``task0``, ``task1``, ...
        **kwargs: the ``Trainer``'s.

    Attributes:
        last_stats: the :class:`~gradbalance.StepStats` of the last step.

    Example:
        >>> import tempfile, torch
        >>> from transformers import TrainingArguments
        >>> from gradbalance.balancers import UPGrad
        >>> from gradbalance.integrations.transformers import BalancedTrainer
        >>> model = torch.nn.Linear(2, 2)
        >>> with tempfile.TemporaryDirectory() as out:  # nothing is written before a save
        ...     trainer = BalancedTrainer(model=model, args=TrainingArguments(out, report_to=[]),
        ...                               balancer=UPGrad(), shared_params=model.parameters())
        >>> trainer.balanced.balancer, trainer.last_stats  # no step yet
        (UPGrad(num_tasks=None, pref=None), None)
    """

    def __init__(
        self,
        *args: Any,
        balancer: Balancer,
        shared_params: ParamSource | None = None,
        head_params: ParamSource | None = None,
        weighting: LossWeighting | None = None,
        clip: RowClipper | None = None,
        buffer_options: Mapping[str, Any] | None = None,
        log_prefix: str = "balance/",
        task_names: Sequence[str] | None = None,
        **kwargs: Any,
    ) -> None:
        options = check_buffer_options("buffer_options", buffer_options)  # before the model
        super().__init__(*args, **kwargs)
        self._fsdp2 = self._check_sharding()
        if self.args.n_gpu > 1:
            raise ValueError(
                f"BalancedTrainer does not run under DataParallel ({self.args.n_gpu} GPUs in "
                f"one process); launch one process per GPU (torchrun / accelerate launch)"
            )
        self._shared_source = _materialize("shared_params", shared_params)
        self._head_source = _materialize("head_params", head_params)
        self._buffer_options = options
        self.balanced = BalancedParts(balancer, self._build_buffer, weighting=weighting,
                                      clip=clip, task_names=task_names)
        self.log_prefix = log_prefix
        self.last_stats: StepStats | None = None
        self._sums: dict[str, Tensor | float] = {}
        self._counts: dict[str, int] = {}  # steps that computed each scalar since the last log
        self._begins_step = True  # the next micro-batch is a step's first
        self._eval_sums: Tensor | None = None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train``; a step that a raise left unfinished in an earlier call is
        dropped first, as the Trainer zeroes the model's gradients when it starts."""
        self.balanced.drop_step()
        self._sums, self._counts, self._begins_step = {}, {}, True
        return super().train(*args, **kwargs)

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """The Trainer's ``model_init`` (each ``train()``, each hyperparameter-search trial):
        the balanced parts restart on the new model, the balancer, the weighting and the
        clipper from the state they were given in."""
        model = super().call_model_init(trial)
        balanced = getattr(self, "balanced", None)  # None: the Trainer's own __init__
        if balanced is not None:
            balanced.restart()
            self._sums, self._counts, self._begins_step = {}, {}, True
        return model

    def _check_sharding(self) -> bool:
        """Raise under DeepSpeed or FSDP1, with the reason; whether the Trainer runs FSDP2."""
        if getattr(self, "is_deepspeed_enabled", False):
            kind, version = "DEEPSPEED", None
        elif getattr(self, "is_fsdp_enabled", False):
            plugin = getattr(getattr(self, "accelerator", None), "state", None)
            kind, version = "FSDP", getattr(getattr(plugin, "fsdp_plugin", None),
                                            "fsdp_version", None)
        else:
            return False
        reason = sharding_refusal(kind, version)
        if reason is not None:
            name = "DeepSpeed" if kind == "DEEPSPEED" else "the Trainer's FSDP1"
            raise ValueError(f"BalancedTrainer does not run under {name}: {reason}. "
                             f"{ALTERNATIVE}")
        return True

    # -- the step ------------------------------------------------------------------------
    def _build_buffer(self) -> TaskGradBuffer:
        model = self.model
        if model is None:
            raise RuntimeError("BalancedTrainer has no model yet: pass model= or model_init=")
        shared = _resolve("shared_params", self._shared_source, model, "shared_parameters")
        if self._head_source is None and not callable(getattr(model, "head_parameters", None)):
            ids = {id(p) for p in shared}
            heads: list[Tensor] = [p for p in model.parameters()
                                   if p.requires_grad and id(p) not in ids]
        else:
            heads = _resolve("head_params", self._head_source, model, "head_parameters")
        if self._fsdp2:
            fix = ("Pass shared_params and head_params as callables model -> parameters, "
                   "called once the Trainer has sharded the model.")
            require_sharded("shared_params", shared, fix)
            require_sharded("head_params", heads, fix)
        return TaskGradBuffer(shared, heads, num_tasks=self.balanced.balancer.num_tasks,
                              **_buffer_options(self._buffer_options, model))

    def compute_task_losses(self, model: nn.Module, inputs: dict[str, Any]
                            ) -> Tensor | Sequence[Tensor]:
        """The K task losses of one micro-batch: ``model(**inputs)["losses"]``.

        Override for a model that returns them otherwise.
        """
        return task_losses_of(model(**inputs))

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Tensor | tuple[Tensor, Any]:
        """The loss of evaluation and prediction: the sum of the K task losses of
        ``model(**inputs)`` (training runs :meth:`training_step`, which balances them).

        Each task's loss is kept for the per-task evaluation losses; the outputs returned
        leave ``losses`` out, so ``predict`` returns the model's other outputs."""
        outputs = model(**inputs)
        losses = task_losses_of(outputs)
        vector = losses if isinstance(losses, Tensor) else torch.stack(list(losses))
        self._eval_record(vector, inputs)
        loss = vector.sum()
        if isinstance(outputs, Mapping):
            outputs = {key: value for key, value in outputs.items() if key != "losses"}
        return (loss, outputs) if return_outputs else loss

    def _eval_record(self, vector: Tensor, inputs: dict[str, Any]) -> None:
        """Adds a batch's task losses, weighted by its size, to the evaluation's sums."""
        n = next((v.shape[0] for v in inputs.values() if isinstance(v, Tensor) and v.dim() > 0),
                 1)
        row = torch.cat([vector.detach().double() * n, vector.new_full((1,), n).double()])
        self._eval_sums = row if self._eval_sums is None else self._eval_sums + row

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's evaluation (``evaluate``, ``predict``), its metrics with each task's
        mean loss: ``<prefix>_loss_<task>`` (e.g. ``eval_loss_task0``), over every process's
        samples."""
        self._eval_sums = None
        output = super().evaluation_loop(*args, **kwargs)
        prefix = kwargs.get("metric_key_prefix", args[4] if len(args) > 4 else "eval")
        if self._eval_sums is not None:
            sums = self.accelerator.reduce(self._eval_sums, reduction="sum")
            means = (sums[:-1] / sums[-1]).tolist()
            for name, value in zip(task_labels(self.balanced.task_names, len(means)), means):
                output.metrics[f"{prefix}_loss_{name}"] = value
            _warn_repeated(int(sums[-1]), output.num_samples, self.args.world_size,
                           self.args.per_device_eval_batch_size)
        self._eval_sums = None
        return output

    def training_step(self, model: nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> Tensor:
        """One micro-batch of the balanced step; returns the detached loss the Trainer logs."""
        parts = self.balanced
        parts.buffer  # noqa: B018 - built on the model's device before the first forward
        model.train()
        train = getattr(self.optimizer, "train", None)
        if callable(train):  # schedule-free optimizers
            train()
        inputs = self._prepare_inputs(inputs)
        if self._begins_step:  # the Trainer zeroes the model's gradients, not a weighting's
            parts.clear_weighting_grads()
            self._begins_step = False
        scaler = getattr(self.accelerator, "scaler", None)
        n = int(getattr(self, "current_gradient_accumulation_steps",
                        self.args.gradient_accumulation_steps))
        with ddp_no_sync(model), fsdp2_sync_on(model):
            with self.compute_loss_context_manager():
                losses = self.compute_task_losses(model, inputs)
            total = parts.backward(losses, n, scaler)
        if self.accelerator.sync_gradients:
            self._begins_step = True
            stats = parts.step(scaler)
            self.last_stats = stats
            self._record(stats)
        return total

    # -- logging -------------------------------------------------------------------------
    def _record(self, stats: StepStats) -> None:
        for name, value in self.balanced.scalars(stats).items():
            value = value.detach().double() if isinstance(value, Tensor) else value
            self._sums[name] = self._sums[name] + value if name in self._sums else value
            self._counts[name] = self._counts.get(name, 0) + 1

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``; a training log also gets each balanced scalar's mean over
        the steps since the last one that computed it (a step reusing ``update_every``'s
        weights computes no norms or cosines)."""
        if "loss" in logs and self._counts:
            for name, total in self._sums.items():
                logs[self.log_prefix + name] = float(total) / self._counts[name]
            self._sums, self._counts = {}, {}
        super().log(logs, *args, **kwargs)

    # -- checkpoints ---------------------------------------------------------------------
    def _state_path(self, folder: str) -> str:
        """The balanced step's file in a checkpoint folder: one per process on a sharded
        trunk (FSDP2)."""
        if self.balanced.buffer.sharded:
            return os.path.join(folder, RANK_STATE_FILE.format(rank=self.args.process_index))
        return os.path.join(folder, STATE_FILE)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save or self.balanced.buffer.sharded:  # each its own state
            save_checkpoint(self._state_path(output_dir), rng=False,
                            step=self.state.global_step, **self.balanced.objects())

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = self._state_path(checkpoint)
        if not os.path.isfile(path):
            raise CheckpointError(
                f"checkpoint folder {checkpoint} has no {os.path.basename(path)}: it was not "
                f"written by BalancedTrainer (or with save_only_model=True"
                f"{', or not on a sharded trunk' if self.balanced.buffer.sharded else ''}), "
                f"so the balancer's state "
                f"cannot be restored; resume from a BalancedTrainer checkpoint"
            )
        if self.balanced.buffer.sharded:
            _check_rank_files(checkpoint, self.args.world_size)
        device = self.args.device if isinstance(self.args.device, torch.device) else None
        if device is not None and device.type == "cpu":
            device = torch.device("cpu")  # a CPU process's "cpu:N" is no torch.load location
        load_checkpoint(path, map_location=device, **self.balanced.objects())


def _check_rank_files(folder: str, world: int) -> None:
    """A sharded run's per-process states resume on as many processes as saved them."""
    prefix, suffix = RANK_STATE_FILE.split("{rank}")
    saved = [name for name in os.listdir(folder)
             if name.startswith(prefix) and name.endswith(suffix)]
    if len(saved) != world:
        raise CheckpointError(
            f"checkpoint folder {folder} holds {len(saved)} processes' states "
            f"({RANK_STATE_FILE.format(rank='N')}), this run has {world} processes: a sharded "
            f"trunk's per-process state (a matrix balancer's columns) resumes on as many "
            f"processes as saved it")
