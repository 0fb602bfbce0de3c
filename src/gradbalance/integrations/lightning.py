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

One call per batch does, in order: ``buf.backward(losses / N)`` with Lightning's gradient
scaler (``precision="16-mixed"``), and on every N-th batch ``buf.apply_``, the optimizer step
through Lightning (which unscales, runs ``on_before_optimizer_step`` — the place for a global
``clip_grad_norm_`` — and steps the scaler), ``zero_grad`` and ``self.log`` of the StepStats.

Under ``strategy="ddp"`` Lightning keeps DDP's reducer off in manual optimisation until
``manual_backward``; the helper never calls it, and the buffer averages the task gradients,
the heads' gradients and the losses over the ranks itself (see :mod:`gradbalance.distributed`);
tested with ``strategy="ddp_spawn"`` on two CPU processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._checks import check_int
from .._optional import require
from ..balancers._base import Balancer
from ..clip._protocol import RowClipper
from ..stats import StepStats
from ..step import TaskGradBuffer
from ..taskgrads import Passes

__all__ = ["BalancedManualStep", "require_lightning", "stats_scalars"]


def require_lightning() -> Any:
    """Import ``lightning.pytorch``, or raise an ImportError naming the extra to install."""
    return require("lightning.pytorch", "lightning", "gradbalance.integrations.lightning")


def stats_scalars(stats: StepStats) -> dict[str, Tensor | float]:
    """The scalars of one step, as tensors (no host sync): losses, norms, weights, cosines."""
    out: dict[str, Tensor | float] = {}
    k = stats.num_tasks
    for t in range(k):
        out[f"loss/task{t}"] = stats.losses[t]
        if stats.task_norms is not None:
            out[f"size/task{t}"] = stats.task_norms[t]
        if stats.weights is not None:
            out[f"w/task{t}"] = stats.weights[t]
    if stats.cosine is not None:
        for i in range(k):
            for j in range(i + 1, k):
                out[f"cos/task{i}_task{j}"] = stats.cosine[i, j]
    if stats.update_norm is not None:
        out["update_norm"] = stats.update_norm
    out["amp_skipped"] = 1.0 if stats.found_inf else 0.0
    return out


class BalancedManualStep:
    """Runs the balanced step inside ``training_step`` of a manual-optimisation module.

    Args:
        balancer: any :class:`~gradbalance.Balancer`.
        shared_params: as for :class:`~gradbalance.TaskGradBuffer`.
        head_params: as for :class:`~gradbalance.TaskGradBuffer`.
        accumulate_grad_batches: N; the losses of each batch are divided by N and the
            optimizer steps every N batches (and at the end of the epoch).
        clip: optional per-task row clipper (e.g. ``TaskClip``), before the combine.
        log: call ``module.log`` for each scalar of :func:`stats_scalars` on a step.
        prefix: prefix of the logged names.
        passes: passed to the buffer.
        process_group: passed to the buffer.
        **buffer_kwargs: passed to the buffer (e.g. ``mode``).

    Attributes:
        buffer: the :class:`~gradbalance.TaskGradBuffer`; ``last_stats``: the last StepStats.
    """

    def __init__(
        self,
        balancer: Balancer,
        shared_params: Iterable[Tensor],
        head_params: Iterable[Tensor] | None = None,
        *,
        accumulate_grad_batches: int = 1,
        clip: RowClipper | None = None,
        log: bool = True,
        prefix: str = "balance/",
        passes: Passes = "auto",
        process_group: Any = None,
        **buffer_kwargs: Any,
    ) -> None:
        check_int("accumulate_grad_batches", accumulate_grad_batches, 1,
                  ", the number of batches per optimizer step")
        self.balancer = balancer
        self.buffer = TaskGradBuffer(
            shared_params, head_params, num_tasks=balancer.num_tasks, passes=passes,
            process_group=process_group, **buffer_kwargs,
        )
        self.accumulate_grad_batches = accumulate_grad_batches
        self.clip = clip
        self.log = log
        self.prefix = prefix
        self.last_stats: StepStats | None = None

    def __call__(
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
        scaler = getattr(module.trainer.precision_plugin, "scaler", None)
        n = self.accumulate_grad_batches
        self.buffer.backward(_divide(losses, n), scaler=scaler)
        last = batch_idx + 1 == module.trainer.num_training_batches
        if (batch_idx + 1) % n != 0 and not last:
            return None
        # training_step runs under Lightning's autocast: balance in the gradients' dtype
        with torch.autocast(self.buffer.layout.device.type, enabled=False):
            stats = self.buffer.apply_(self.balancer, scaler=scaler, clip=self.clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.last_stats = stats
        if self.log:
            for name, value in stats_scalars(stats).items():
                module.log(self.prefix + name, value, on_step=True, on_epoch=False)
        return stats


def _divide(losses: Tensor | Sequence[Tensor], n: int) -> Tensor | Sequence[Tensor]:
    if n == 1:
        return losses
    if isinstance(losses, Tensor):
        return losses / n
    return [loss / n for loss in losses]
