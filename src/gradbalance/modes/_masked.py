"""Partial labels: a per-task mask that drops tasks out of one step's balancing.

``apply_(balancer, active=mask)`` runs the balancer on the active tasks' rows only (their
Gramian block and losses) and gives the inactive tasks zero weight (docs/loop.md, "Partial
labels"). A balancer with per-task state or settings runs as if built for the active tasks:
each declared per-task state (and each setting named in ``per_task_settings``, Constant's
weights) is sliced to the active tasks for the call, and the step's new state is written into
the active tasks' entries only; state that is not per task (a step counter, a generator) moves
as on any step. A per-task state not set yet (before the balancer's first step) stays unset:
the step runs as the balancer's first on the active tasks, and the first step with every
task active sets it for all. A per-task state trained in place is refused
(docs/ARCHITECTURE.md, "Extension contract").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from .._module import StateModule
from .._shard import Shard
from ..balancers._base import Balancer, Combination
from ._rollback import StateSnapshot

__all__ = ["MaskedBalancer", "check_active", "mask_balancer"]


def check_active(active: Any, k: int) -> Tensor | None:
    """The active tasks' indices ``[K']`` (None: every task is active, or no mask).

    Raises ``ValueError``/``TypeError`` naming ``active`` for anything but a bool ``[K]``
    tensor with at least one True entry.
    """
    if active is None:
        return None
    mask = check_active_mask(active, k)
    if not bool(mask.any()):
        raise ValueError(f"active is all False ({mask.tolist()}): no task has labels in this "
                         f"batch, so there is nothing to balance; skip the step (do not call "
                         f"backward/apply_ for it)")
    return None if bool(mask.all()) else mask.nonzero().reshape(-1)


def check_active_mask(active: Any, k: int) -> Tensor:
    """``active`` as a bool ``[K]`` CPU tensor; raises ``ValueError``/``TypeError`` naming
    ``active`` for anything else (an all-False mask passes: data-parallel ranks combine
    theirs first)."""
    if not isinstance(active, Tensor) or active.dtype != torch.bool:
        found = active.dtype if isinstance(active, Tensor) else type(active).__name__
        raise TypeError(f"active must be a bool tensor [K] (True: the task has labels in this "
                        f"batch), got {found}; pass e.g. torch.tensor([True, False, True])")
    if active.dim() != 1 or active.numel() != k:
        raise ValueError(f"active must have shape [K] = [{k}] (one entry per task), got "
                         f"shape {tuple(active.shape)}")
    return active.detach().cpu()


def check_maskable(balancer: Balancer) -> None:
    """Raise ``ValueError`` when a per-task state of ``balancer`` (or of a stateful part of
    it) cannot be sliced to the active tasks: one an optimizer steps in place."""
    for module in balancer.modules():
        if not isinstance(module, StateModule):
            continue
        for name, (_, value) in module.task_state().items():
            if value is not None and (isinstance(value, nn.Parameter) or value.requires_grad):
                raise ValueError(
                    f"{type(module).__name__} trains its per-task state {name!r} in place (an "
                    f"optimizer holds it), so a step on only the active tasks cannot take a "
                    f"slice of it; it refuses a mask that is not all True. Pass active=None "
                    f"(or all True), or use a balancer without trained per-task state"
                )


class MaskedBalancer(Balancer):
    """``balancer`` on the rows ``index`` of ``K`` tasks; the other tasks get weight 0."""

    def __init__(self, balancer: Balancer, index: Tensor, k: int) -> None:
        super().__init__()
        self.inner = balancer
        self.index = index
        self.k = k
        self.from_gramian = balancer.from_gramian
        self.homogeneous = balancer.homogeneous
        self.needs_losses = balancer.needs_losses

    @property
    def shardable(self) -> bool:
        return self.inner.shardable

    def check_shardable(self) -> None:
        self.inner.check_shardable()

    def combine(self, matrix: Tensor, losses: Tensor | None = None,
                gramian: Tensor | None = None, shard: Shard | None = None) -> Combination:
        idx = self.index.to(matrix.device)
        sub_gram = None if gramian is None else _block(gramian, self.index)
        with _OnActive(self.inner, self.index, self.k):
            out = self.inner.combine(matrix[idx], _rows(losses, self.index), sub_gram, shard)
        return Combination(out.vector, self._scatter(out.weights))

    def compute_weights(self, gramian: Tensor, losses: Tensor | None = None, *,
                        rounding: float = 0.0) -> Tensor:
        with _OnActive(self.inner, self.index, self.k):
            w = self.inner.compute_weights(_block(gramian, self.index),
                                           _rows(losses, self.index), rounding=rounding)
        out = self._scatter(w)
        assert out is not None
        return out

    def _scatter(self, weights: Tensor | None) -> Tensor | None:
        if weights is None:
            return None
        full = weights.new_zeros(self.k)
        full[self.index.to(weights.device)] = weights
        return full


def mask_balancer(balancer: Balancer, index: Tensor | None, k: int) -> Balancer:
    """``balancer`` itself without a mask, else its :class:`MaskedBalancer` (checked)."""
    if index is None:
        return balancer
    check_maskable(balancer)
    balancer.check_tracked_tasks(k)
    return MaskedBalancer(balancer, index, k)


def _block(gramian: Tensor, index: Tensor) -> Tensor:
    idx = index.to(gramian.device)
    return gramian[idx][:, idx]


def _rows(losses: Tensor | None, index: Tensor) -> Tensor | None:
    if losses is None:
        return None
    losses = torch.as_tensor(losses)
    return losses.reshape(-1)[index.to(losses.device)]


class _OnActive:
    """One call of ``balancer`` on the active tasks ``index`` (of ``k``), as a balancer built
    for them: every ``num_tasks`` None, the per-task settings and states sliced to the active
    tasks. On success each state's result goes into the active tasks' entries (the others
    as before) and the settings come back; on failure everything is put back."""

    def __init__(self, balancer: Balancer, index: Tensor, k: int) -> None:
        self.balancer, self.index, self.k = balancer, index, k
        self.snapshot = StateSnapshot(balancer)
        self.settings = {name: getattr(balancer, name) for name in balancer.per_task_settings}
        self.counts = [(module, module.num_tasks) for module in balancer.modules()
                       if isinstance(module, Balancer)]
        self.states = [(module, name, spec, value) for module in balancer.modules()
                       if isinstance(module, StateModule)
                       for name, (spec, value) in module.task_state().items()]

    def __enter__(self) -> None:
        for counted, _ in self.counts:
            counted.num_tasks = None
        for name, value in self.settings.items():
            setattr(self.balancer, name, value[self.index.to(value.device)])
        for module, name, spec, value in self.states:
            module.put_state(name, None if value is None else spec.on_tasks(value, self.index))

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        if kind is not None:
            self.snapshot.restore()
            return
        for module, name, spec, before in self.states:
            after = module.task_state()[name][1]
            module.put_state(name, None if after is None or before is None
                             else spec.into_tasks(before, after, self.index))
        for counted, count in self.counts:
            counted.num_tasks = count
        for name, value in self.settings.items():
            setattr(self.balancer, name, value)
