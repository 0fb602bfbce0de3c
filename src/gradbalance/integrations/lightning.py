"""Lightning integration: the balanced step in a ``LightningModule`` with manual optimisation.

Lightning is optional (``pip install gradbalance[lightning]``). Use::

    class Model(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = MultiTaskModel(...)
            self.balanced = BalancedManualStep(
                gradbalance.get_balancer("pcgrad"),
                self.net.shared_parameters(), self.net.head_parameters(),
                accumulate_grad_batches=2)

        def training_step(self, batch, batch_idx):
            losses = task_losses(self.net, batch)          # Tensor[K], batch means
            self.balanced(self, losses, batch_idx)          # backward, balance, step, log

One call per batch runs the weighting, ``buf.backward(losses / N)`` with Lightning's scaler,
and every N-th batch ``buf.apply_``, the optimizer step through Lightning, ``zero_grad``, the
schedulers and ``self.log``; its state travels in Lightning's checkpoints. What each stage
does, checkpoints, precision, DDP: docs/integrations.md, "Lightning".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from .._checks import check_bool, check_int
from .._optional import require
from ..balancers._base import Balancer
from ..balancers._checks import check_balancer
from ..clip._protocol import RowClipper
from ..stats import StepStats
from ..step import TaskGradBuffer
from ..taskgrads import Passes
from ..weighting._base import LossWeighting
from ._core import BalancedParts, check_buffer_options, stats_scalars, unshare_tensors

__all__ = ["BalancedManualStep", "require_lightning", "stats_scalars"]


def _last_batch(trainer: Any, batch_idx: int) -> bool:
    """Whether ``batch_idx`` is the epoch's last batch: by the number of batches, or, for a
    loader without a length (``num_training_batches`` infinite, where that test never held
    and the end-of-epoch step was never taken), by the fit loop's own flag, which its
    prefetching data fetcher sets."""
    total = trainer.num_training_batches
    if total != float("inf"):
        return bool(batch_idx + 1 == total)
    progress = getattr(getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None),
                       "batch_progress", None)
    return bool(getattr(progress, "is_last_batch", False))

def _step(configs: list[Any], trainer: Any, batch_idx: int, last_of_epoch: bool) -> None:
    """Step the schedulers due after the optimizer step of batch ``batch_idx``, as
    Lightning's automatic loop does (``TrainingEpochLoop._update_learning_rates``):
    ``"step"`` ones where the batch's index in its epoch plus one is a multiple of
    ``frequency`` (with accumulation, on the batches that step the optimizer only),
    ``"epoch"`` ones on the epoch's last batch every ``frequency`` epochs."""
    for config in configs:
        if config.interval == "step":
            due = (batch_idx + 1) % config.frequency == 0
        else:
            due = last_of_epoch and (trainer.current_epoch + 1) % config.frequency == 0
        if due:
            config.scheduler.step()


def require_lightning() -> Any:
    """Import ``lightning.pytorch``, or raise an ImportError naming the extra to install.

    Example:
        >>> from gradbalance.integrations.lightning import require_lightning
        >>> require_lightning().__name__
        'lightning.pytorch'
    """
    return require("lightning.pytorch", "lightning", "gradbalance.integrations.lightning")


class BalancedManualStep(nn.Module):
    """Runs the balanced step inside ``training_step`` of a manual-optimisation module.

    Args:
        balancer: any :class:`~gradbalance.Balancer`.
        shared_params: as for :class:`~gradbalance.TaskGradBuffer`.
        head_params: as for :class:`~gradbalance.TaskGradBuffer`.
        accumulate_grad_batches: N; the losses of each batch are divided by N and the
            optimizer steps every N batches (and at the end of the epoch).
        clip: optional per-task row clipper (e.g. ``TaskClip``), before the combine.
        weighting: optional :class:`~gradbalance.LossWeighting` (e.g. GradNorm): applied to
            each batch's losses, updated once per optimizer step.
        log: call ``module.log`` for each scalar of :func:`stats_scalars` on a step (and
            ``weighting/<task>``, the weighting's weights).
        prefix: prefix of the logged names.
        task_names: the tasks' names in the logged names (``balance/loss/depth``); default
            ``task0``, ``task1``, ...
        step_schedulers: step the learning-rate schedulers of ``configure_optimizers`` as
            Lightning's automatic loop would (``ReduceLROnPlateau`` is refused: pass
            ``False`` and step it yourself; docs/integrations.md, "Lightning").
        passes: passed to the buffer.
        process_group: passed to the buffer.
        **buffer_kwargs: passed to the buffer (e.g. ``mode``).

    Attributes:
        buffer: the :class:`~gradbalance.TaskGradBuffer`; ``last_stats``: the last StepStats.

    Assign it as an attribute of the ``LightningModule`` (``self.balanced = ...``): its state
    then travels in the module's ``state_dict`` and so in Lightning's checkpoints.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import UPGrad
        >>> from gradbalance.integrations.lightning import BalancedManualStep
        >>> trunk, heads = torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)
        >>> balanced = BalancedManualStep(UPGrad(), trunk.parameters(), heads.parameters())
        >>> balanced.balancer, list(balanced.state_dict())  # its state, for the checkpoints
        (UPGrad(num_tasks=None, pref=None), ['_extra_state'])
    """

    def __init__(
        self,
        balancer: Balancer,
        shared_params: Iterable[Tensor],
        head_params: Iterable[Tensor] | None = None,
        *,
        accumulate_grad_batches: int = 1,
        clip: RowClipper | None = None,
        weighting: LossWeighting | None = None,
        log: bool = True,
        prefix: str = "balance/",
        task_names: Sequence[str] | None = None,
        step_schedulers: bool = True,
        passes: Passes = "auto",
        process_group: Any = None,
        **buffer_kwargs: Any,
    ) -> None:
        super().__init__()
        check_int("accumulate_grad_batches", accumulate_grad_batches, 1,
                  ", the number of batches per optimizer step")
        check_balancer("balancer", balancer)  # before balancer.num_tasks is read
        self.log = check_bool("log", log)
        if not isinstance(prefix, str):
            raise ValueError(f"Invalid prefix: {prefix!r} (expected a string, e.g. 'train/')")
        self._params = (list(shared_params), None if head_params is None else list(head_params))
        self._buffer_kwargs = {"num_tasks": balancer.num_tasks, "passes": passes,
                               "process_group": process_group,
                               **check_buffer_options("buffer_kwargs", buffer_kwargs)}
        self.parts = BalancedParts(balancer, self._new_buffer(), weighting=weighting, clip=clip,
                                   task_names=task_names)
        self._placed = self._placement()
        self.accumulate_grad_batches = accumulate_grad_batches
        self.prefix = prefix
        self.step_schedulers = check_bool("step_schedulers", step_schedulers)
        self.last_stats: StepStats | None = None
        #: The ``.grad`` each parameter held after an accumulating batch (the window's).
        self._held: list[tuple[Tensor, Tensor]] = []

    @property
    def balancer(self) -> Balancer:
        """The balancer."""
        return self.parts.balancer

    @property
    def buffer(self) -> TaskGradBuffer:
        """The :class:`~gradbalance.TaskGradBuffer`."""
        return self.parts.buffer

    @property
    def weighting(self) -> LossWeighting | None:
        """The loss weighting, or None."""
        return self.parts.weighting

    @property
    def clip(self) -> RowClipper | None:
        """The row clipper, or None."""
        return self.parts.clip

    def forward(
        self,
        module: Any,
        losses: Tensor | Sequence[Tensor],
        batch_idx: int,
        optimizer: Any = None,
    ) -> StepStats | None:
        """Backward of this batch; on a step batch also balance, step and log.

        Returns the StepStats on a step batch, None on an accumulating one. ``optimizer``:
        the (Lightning) optimizer to step; default ``module.optimizers()`` (one optimizer).
        """
        require_lightning()
        if module.automatic_optimization:
            raise ValueError(
                "BalancedManualStep needs manual optimisation: set "
                "self.automatic_optimization = False in the LightningModule's __init__"
            )
        if optimizer is None:
            optimizer = module.optimizers()
            if isinstance(optimizer, (list, tuple)):
                raise ValueError(
                    f"the module has {len(optimizer)} optimizers; pass the one to step as "
                    f"optimizer=..."
                )
        schedulers = self._schedulers(module, optimizer)
        scaler = getattr(module.trainer.precision_plugin, "scaler", None)
        n = self.accumulate_grad_batches
        self._resume_window(module, batch_idx)  # first: a dropped step lets the buffer follow
        self._follow_placement()
        self.parts.backward(losses, n, scaler)
        last = _last_batch(module.trainer, batch_idx)
        if (batch_idx + 1) % n != 0 and not last:
            self._held = [(p, p.grad) for p in module.parameters() if p.grad is not None]
            return None
        self._held = []
        stats = self.parts.step(scaler)  # autocast off: balanced in the gradients' dtype
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _step(schedulers, module.trainer, batch_idx, last)
        self.last_stats = stats
        if self.log:
            for name, value in self.parts.scalars(stats).items():
                module.log(self.prefix + name, value, on_step=True, on_epoch=False)
        return stats

    def _new_buffer(self) -> TaskGradBuffer:
        shared, heads = self._params
        return TaskGradBuffer(shared, heads, **self._buffer_kwargs)

    def _placement(self) -> list[tuple[Any, Any]]:
        """Each parameter's dtype and device."""
        shared, heads = self._params
        return [(p.dtype, p.device) for p in [*shared, *(heads or [])]]

    def _follow_placement(self) -> None:
        """Lightning converts the module after its ``__init__`` built this step (``precision=
        "bf16-true"``/``"64-true"``, the move to the GPU): between steps, the buffer is built
        again over the same parameters, its state carried over (update_every's weights, the
        steps begun). Within a step, the buffer's own error names the change."""
        placed = self._placement()
        if placed == self._placed or self.buffer.in_step:
            return
        buffer = self._new_buffer()
        buffer.load_state_dict(self.buffer.state_dict())
        self.parts.replace_buffer(buffer)
        self._placed = placed

    def _resume_window(self, module: Any, batch_idx: int) -> None:
        """Lightning's own ``zero_grad`` inside an accumulation window, where automatic
        optimisation (``accumulate_grad_batches``) would not have called it: manual
        optimisation runs ``on_validation_model_zero_grad`` before a validation run (a
        ``val_check_interval`` that ends inside a window) and every ``fit`` begins with one
        (after a run stopped inside a window). Mid-window, the gradients set to None are put
        back (the same tensors: automatic optimisation goes on accumulating across the
        validation); at a window's first batch, the unfinished step is dropped (the new
        ``fit`` starts clean, as automatic optimisation's does)."""
        if not self.buffer.in_step:
            return
        if batch_idx % self.accumulate_grad_batches == 0:
            self.parts.drop_step()
        elif self._held and all(p.grad is None for p, _ in self._held):
            for p, grad in self._held:
                p.grad = grad

    def _schedulers(self, module: Any, optimizer: Any) -> list[Any]:
        """The scheduler configurations of ``optimizer`` to step (none when switched off);
        a ``ReduceLROnPlateau`` is refused before the step, naming the fix."""
        if not self.step_schedulers:
            return []
        torch_optimizer = getattr(optimizer, "optimizer", optimizer)
        configs = [c for c in getattr(module.trainer, "lr_scheduler_configs", None) or []
                   if getattr(c.scheduler, "optimizer", None) is torch_optimizer]
        if any(c.reduce_on_plateau or isinstance(c.scheduler, ReduceLROnPlateau)
               for c in configs):
            raise ValueError(
                "BalancedManualStep cannot step a ReduceLROnPlateau scheduler (it needs the "
                "monitored metric): pass step_schedulers=False and call "
                "self.lr_schedulers().step(metric) yourself, e.g. in on_validation_epoch_end"
            )
        return configs

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled (``ddp_spawn`` on CPU): the parts' tensors get memory of their own."""
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        unshare_tensors(self.parts)

    def get_extra_state(self) -> dict[str, Any]:
        """The buffer's, balancer's, weighting's and clipper's states (in ``state_dict``)."""
        return self.parts.state_dict()

    def set_extra_state(self, state: Any) -> None:
        """Restore :meth:`get_extra_state` output (all parts or none). A step an earlier
        ``fit`` left unfinished (stopped inside an accumulation window) is dropped first, as
        the next ``fit`` would: a checkpoint's state replaces it. Between steps nothing else
        is touched."""
        if self.buffer.in_step:
            self.parts.drop_step()
        self.parts.load_state_dict(state)
