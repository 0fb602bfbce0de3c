"""Accelerate integration: the balanced step in a loop driven by an ``accelerate.Accelerator``.

accelerate is optional (``pip install gradbalance[accelerate]``); this module does not import
it. The recipe, with the helper::

    accelerator = Accelerator(gradient_accumulation_steps=2)      # mixed_precision=..., DDP
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = BalancedAcceleratorStep(accelerator, balancer,
                                   trunk.parameters(), heads.parameters())
    accelerator.register_for_checkpointing(step)                   # save_state / load_state
    for x, y in loader:
        with step.accumulate(model):                               # accumulate + DDP no_sync
            stats = step.backward(task_losses(model(x), y))        # StepStats on a sync step
            if stats is not None:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)   # global clip
            optimizer.step()                                       # skipped while accumulating
            optimizer.zero_grad()

The helper holds four lines of the loop (``buf.backward(losses / N, scaler=...)`` under
``accumulate`` and DDP's ``no_sync``, ``buf.apply_`` on ``accelerator.sync_gradients``, and
the weighting's call, sync and update); the loop written out, FSDP2, and why FSDP1 and
DeepSpeed are refused: docs/integrations.md, "Accelerate".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import Tensor, nn

from ..balancers._base import Balancer
from ..clip._protocol import RowClipper
from ..distributed import ddp_no_sync
from ..stats import StepStats
from ..step import TaskGradBuffer
from ..weighting._base import LossWeighting
from ._core import BalancedParts, check_buffer_options
from ._sharded import ALTERNATIVE, fsdp2_sync_on, require_sharded, sharding_refusal

__all__ = ["BalancedAcceleratorStep"]

def _refuse_sharding(accelerator: Any) -> bool:
    """Raise for an accelerator whose sharding the helper cannot run under (FSDP1,
    DeepSpeed), with the reason; whether the model is under FSDP2."""
    kind = getattr(accelerator, "distributed_type", None)
    name = str(getattr(kind, "value", kind))
    plugin = getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)
    reason = sharding_refusal(name, getattr(plugin, "fsdp_version", None))
    if reason is not None:
        raise ValueError(
            f"BalancedAcceleratorStep does not run under accelerator.distributed_type={name}"
            f"{'' if name != 'FSDP' else ' with fsdp_version=1'}: {reason}. {ALTERNATIVE}")
    return name == "FSDP"


class BalancedAcceleratorStep:
    """The balanced step of an ``accelerate`` loop, with its state in one object.

    Args:
        accelerator: the ``accelerate.Accelerator`` of the loop.
        balancer: any :class:`~gradbalance.Balancer`.
        shared_params: the trunk's parameters (of the model given to ``prepare``; read now,
            the buffer is built on the first call, after ``prepare`` placed them; under
            FSDP2, whose ``fully_shard`` replaces them, read after ``prepare``).
        head_params: the heads' parameters.
        weighting: optional :class:`~gradbalance.LossWeighting`.
        clip: optional row clipper (e.g. :class:`~gradbalance.TaskAutoClip`).
        **buffer_kwargs: passed to :class:`~gradbalance.TaskGradBuffer` (``mode``, ...).

    ``state_dict``/``load_state_dict`` hold the buffer's, balancer's, weighting's and
    clipper's states: pass the object to ``accelerator.register_for_checkpointing``.
    Under FSDP2 build it after ``prepare`` (the parameters must be the sharded model's);
    an accelerator under FSDP1 or DeepSpeed raises ``ValueError`` (the reason:
    docs/integrations.md, "Accelerate").

    Example:
        >>> import torch
        >>> from accelerate import Accelerator
        >>> from gradbalance.balancers import UPGrad
        >>> from gradbalance.integrations.accelerate import BalancedAcceleratorStep
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> step = BalancedAcceleratorStep(Accelerator(), UPGrad(), [w])
        >>> _ = step.backward([w @ torch.tensor([1.0, 0.0]), w @ torch.tensor([-1.0, 1.0])])
        >>> w.grad  # a sync step (no accumulation): UPGrad of the rows, as in its example
        tensor([0.2500, 0.7500])
    """

    def __init__(
        self,
        accelerator: Any,
        balancer: Balancer,
        shared_params: Iterable[Tensor],
        head_params: Iterable[Tensor] | None = None,
        *,
        weighting: LossWeighting | None = None,
        clip: RowClipper | None = None,
        **buffer_kwargs: Any,
    ) -> None:
        if not hasattr(accelerator, "sync_gradients"):
            raise TypeError(f"Invalid accelerator: a {type(accelerator).__name__} (expected "
                            f"an accelerate.Accelerator)")
        fsdp2 = _refuse_sharding(accelerator)
        shared = list(shared_params)
        heads = [] if head_params is None else list(head_params)
        if fsdp2:
            fix = "Build BalancedAcceleratorStep after accelerator.prepare(model, ...)."
            require_sharded("shared_params", shared, fix)
            require_sharded("head_params", heads, fix)

        options = check_buffer_options("buffer_kwargs", buffer_kwargs)

        def build() -> TaskGradBuffer:
            return TaskGradBuffer(shared, heads, num_tasks=balancer.num_tasks, **options)

        self.accelerator = accelerator
        self.parts = BalancedParts(balancer, build, weighting=weighting, clip=clip)
        self.last_stats: StepStats | None = None

    @property
    def buffer(self) -> TaskGradBuffer:
        """The :class:`~gradbalance.TaskGradBuffer` (built on first use)."""
        return self.parts.buffer

    @contextlib.contextmanager
    def accumulate(self, model: nn.Module) -> Iterator[None]:
        """``accelerator.accumulate(model)`` with DDP's ``no_sync`` on every micro-batch
        (FSDP2's gradient sync kept on)."""
        with self.accelerator.accumulate(model), ddp_no_sync(model), fsdp2_sync_on(model):
            yield

    def backward(self, losses: Tensor | Sequence[Tensor]) -> StepStats | None:
        """This micro-batch's backward; on a sync step also the balance (and the weighting's
        update). Returns the StepStats on a sync step, None while accumulating."""
        scaler = getattr(self.accelerator, "scaler", None)
        self.parts.backward(losses, int(self.accelerator.gradient_accumulation_steps), scaler)
        if not self.accelerator.sync_gradients:
            return None
        self.last_stats = self.parts.step(scaler)
        return self.last_stats

    def drop_step(self) -> None:
        """Drop a step a failed micro-batch left unfinished (an out-of-memory forward): the
        buffer's step (its ``update_every`` weights kept), the weighting's observation and
        the ``.grad`` the step wrote; call it before retrying or before
        ``accelerator.load_state`` (which refuses a buffer in the middle of a step)."""
        self.parts.drop_step()

    def state_dict(self) -> dict[str, Any]:
        """The buffer's, balancer's, weighting's and clipper's states (under FSDP2 every
        rank's: a collective)."""
        return self.parts.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (all parts or none)."""
        self.parts.load_state_dict(state_dict)
