"""Partial labels: a per-task mask that drops tasks out of one step's balancing.

``apply_(balancer, active=mask)`` runs the balancer on the active tasks' rows only (their
Gramian block and losses) and gives the inactive tasks zero weight (docs/loop.md, "Partial
labels"). A balancer with per-task state (or settings: Constant) refuses a mask that is not
all true: its state tracks every task, and a step on fewer rows would misalign it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._module import StateModule
from .._shard import Shard
from ..balancers._base import Balancer, Combination

__all__ = ["MaskedBalancer", "check_active", "mask_balancer"]


def check_active(active: Any, k: int) -> Tensor | None:
    """The active tasks' indices ``[K']`` (None: every task is active, or no mask).

    Raises ``ValueError``/``TypeError`` naming ``active`` for anything but a bool ``[K]``
    tensor with at least one True entry.
    """
    if active is None:
        return None
    if not isinstance(active, Tensor) or active.dtype != torch.bool:
        found = active.dtype if isinstance(active, Tensor) else type(active).__name__
        raise TypeError(f"active must be a bool tensor [K] (True: the task has labels in this "
                        f"batch), got {found}; pass e.g. torch.tensor([True, False, True])")
    if active.dim() != 1 or active.numel() != k:
        raise ValueError(f"active must have shape [K] = [{k}] (one entry per task), got "
                         f"shape {tuple(active.shape)}")
    mask = active.detach().cpu()
    if not bool(mask.any()):
        raise ValueError(f"active is all False ({mask.tolist()}): no task has labels in this "
                         f"batch, so there is nothing to balance; skip the step (do not call "
                         f"backward/apply_ for it)")
    return None if bool(mask.all()) else mask.nonzero().reshape(-1)


def check_maskable(balancer: Balancer) -> None:
    """Raise ``ValueError`` when ``balancer`` (or a stateful part of it) keeps per-task state
    or settings."""
    if balancer.per_task_settings:
        raise ValueError(
            f"{type(balancer).__name__} has one setting per task ({balancer!r}), which does not "
            f"say what to do with fewer tasks; it refuses a mask that is not all True. Pass "
            f"active=None, or build it for the active tasks and call it on them yourself"
        )
    for module in balancer.modules():
        if isinstance(module, StateModule) and any(
                spec.task_dim is not None for spec in module.state_specs.values()):
            raise ValueError(
                f"{type(balancer).__name__} keeps per-task state, which a step on only the "
                f"active tasks would misalign; it refuses a mask that is not all True. Pass "
                f"active=None (or all True), or use a balancer without per-task state "
                f"(e.g. UPGrad, MGDA, IMTL-G, PCGrad)"
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
        with _unbounded(self.inner):
            out = self.inner.combine(matrix[idx], _rows(losses, self.index), sub_gram, shard)
        return Combination(out.vector, self._scatter(out.weights))

    def compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        with _unbounded(self.inner):
            w = self.inner.compute_weights(_block(gramian, self.index),
                                           _rows(losses, self.index))
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
    return MaskedBalancer(balancer, index, k)


def _block(gramian: Tensor, index: Tensor) -> Tensor:
    idx = index.to(gramian.device)
    return gramian[idx][:, idx]


def _rows(losses: Tensor | None, index: Tensor) -> Tensor | None:
    if losses is None:
        return None
    losses = torch.as_tensor(losses)
    return losses.reshape(-1)[index.to(losses.device)]


class _unbounded:
    """``balancer.num_tasks`` set to None for one call on fewer rows (restored after)."""

    def __init__(self, balancer: Balancer) -> None:
        self.balancer = balancer
        self.saved = balancer.num_tasks

    def __enter__(self) -> None:
        self.balancer.num_tasks = None

    def __exit__(self, *exc: object) -> None:
        self.balancer.num_tasks = self.saved
