"""The balanced step: replaces ``sum(losses).backward()`` in the user's loop.

Stages (seed 000 §3, DESIGN §2):

1. ``backward(losses)``: the heads get ``.grad +=`` their plain gradient of ``Σₖ Lₖ``; the
   trunk's per-task gradients are added into a persistent ``[K, P]`` buffer ``G``. Call it
   once per micro-batch.
2. ``apply_(balancer)``: unscale ``G`` by the ``GradScaler`` scale, check it is finite
   (O(K), from the Gramian's diagonal), optionally clip rows, combine once, and add the result
   (re-scaled) into the trunk's ``.grad``. Returns :class:`~gradbalance.StepStats`.

The optimizer step, ``zero_grad`` and global clipping stay in the user's loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from ._types import NonFiniteGradientError, as_loss_vector, as_parameter_list
from .balancers._base import Balancer, Combination
from .gramian import compute_gramian, is_finite_gramian
from .stats import StepStats, stats_from_gramian
from .taskgrads import ParamLayout, Strategy, compute_into, resolve_strategy

__all__ = ["RowClipper", "TaskGradBuffer", "balanced_backward"]


class RowClipper(Protocol):
    """Clips the rows of ``G`` in place before the combine and returns their pre-clip norms."""

    def __call__(self, matrix: Tensor) -> Tensor: ...


def _scale_of(scaler: Any, device: torch.device) -> Tensor | None:
    """The scaler's current scale as a 0-d tensor (no host sync), or None when disabled."""
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler.scale(torch.ones((), dtype=torch.float32, device=device))


class TaskGradBuffer:
    """Accumulates per-task gradients of the shared parameters and balances them once.

    Args:
        shared_params: the trunk's parameters (all must require grad).
        head_params: task-specific parameters; they receive their plain gradient of the
            summed losses (the PCGrad paper's rule), accumulated with ``+=``.
        num_tasks: K, checked on every call; inferred from the first ``backward`` if None.
        strategy: ``"auto"``, ``"loop"`` or ``"batched"`` (see :mod:`gradbalance.taskgrads`).

    Example:
        >>> buf = TaskGradBuffer(model.trunk.parameters(), head_params=model.heads.parameters())
        >>> buf.backward(torch.stack(losses))
        >>> stats = buf.apply_(gradbalance.PCGrad())
        >>> optimizer.step(); optimizer.zero_grad()
    """

    def __init__(
        self,
        shared_params: Iterable[Tensor],
        head_params: Iterable[Tensor] | None = None,
        *,
        num_tasks: int | None = None,
        strategy: Strategy = "auto",
    ) -> None:
        shared = as_parameter_list(shared_params, "shared_params")
        heads = as_parameter_list(head_params, "head_params", allow_empty=True)
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
        self.layout = ParamLayout(shared)
        self.head_params = heads
        self.num_tasks = num_tasks
        resolve_strategy(strategy, self.layout.device)
        self.strategy: Strategy = strategy
        self._matrix: Tensor | None = None
        self._losses: Tensor | None = None
        self._count = 0
        self._scaler: Any = None
        self._scale: Tensor | None = None

    # -- stage 1 ------------------------------------------------------------------------
    def backward(self, losses: Tensor | Sequence[Tensor], scaler: Any = None) -> None:
        """Add this micro-batch's task gradients into ``G`` and the heads' ``.grad``.

        ``losses`` are the K task losses (batch means; divide by the number of micro-batches
        yourself if you want their average). With a ``GradScaler``, pass it here and to
        :meth:`apply_`; the scaled losses are backpropagated, as ``scaler.scale`` would.
        """
        vector = as_loss_vector(losses, self.num_tasks)
        k = vector.shape[0]
        if self._count > 0 and scaler is not self._scaler:
            raise ValueError(
                "scaler differs from the one given to the earlier backward() of this step; "
                "pass the same GradScaler (or None) to every backward() and to apply_()"
            )
        if self.num_tasks is None:
            self.num_tasks = k
        scale = _scale_of(scaler, vector.device)
        scaled = vector if scale is None else vector * scale.to(vector.dtype)

        if self._matrix is None or self._matrix.shape[0] != k:
            self._matrix = torch.empty(
                k, self.layout.numel, dtype=self.layout.dtype, device=self.layout.device
            )
        first = self._count == 0
        if self.head_params:
            torch.autograd.backward(scaled.sum(), inputs=self.head_params, retain_graph=True)
        compute_into(scaled, self.layout, self._matrix, strategy=self.strategy,
                     accumulate=not first, retain_graph=False)
        detached = vector.detach()
        self._losses = detached.clone() if first or self._losses is None else (
            self._losses + detached
        )
        self._count += 1
        self._scaler = scaler
        self._scale = scale

    # -- stage 2 ------------------------------------------------------------------------
    def apply_(
        self,
        balancer: Balancer,
        scaler: Any = None,
        clip: RowClipper | None = None,
    ) -> StepStats:
        """Balance the accumulated task gradients once and add the result into ``.grad``.

        With a scaler, ``G`` is unscaled first (so norms, clipping and scale-sensitive
        balancers see true gradients) and the result is re-scaled on write-back, so that
        ``scaler.unscale_``, ``clip_grad_norm_`` and ``scaler.step`` work unchanged. If ``G``
        holds inf/NaN: with a scaler, the plain (non-finite) sum is written so the scaler skips
        the step and the balancer is not called; without one, ``NonFiniteGradientError`` is
        raised and ``.grad`` of the trunk is left unchanged.
        """
        if self._count == 0 or self._matrix is None or self._losses is None:
            raise RuntimeError(
                "apply_() called before any backward(); call buf.backward(losses) for each "
                "micro-batch first"
            )
        if scaler is not self._scaler:
            raise ValueError(
                "scaler differs from the one given to backward(); pass the same GradScaler "
                "(or None) to backward() and apply_()"
            )
        matrix, losses, scale, count = self._matrix, self._losses, self._scale, self._count
        self._count = 0  # the buffer is free again whatever happens below
        if scale is not None:
            matrix.div_(scale.to(matrix.dtype))
        gram = compute_gramian(matrix)
        finite = bool(is_finite_gramian(gram))
        pre_clip = None
        if finite and clip is not None:
            pre_clip = clip(matrix)
            gram = compute_gramian(matrix)
        if finite:
            result = balancer.combine(matrix, losses, gramian=gram)
        elif scale is not None:
            result = Combination(matrix.sum(dim=0))
        else:
            raise NonFiniteGradientError(
                "task gradients hold inf or NaN (no GradScaler given); the trunk's .grad and "
                "the balancer's state are unchanged. Skip this optimizer step "
                "(optimizer.zero_grad()) or find the source of the overflow"
            )
        self._write_back(result.vector, scale)
        if finite:
            norms, cosine, cos_update, update_norm = stats_from_gramian(
                gram, losses, matrix, result.vector, result.weights
            )
        else:
            k = matrix.shape[0]
            nan = torch.full((k,), float("nan"), dtype=torch.float64, device=matrix.device)
            norms, cos_update = torch.diagonal(gram).sqrt(), nan
            cosine = torch.full((k, k), float("nan"), dtype=torch.float64, device=matrix.device)
            update_norm = nan[0]
        return StepStats(
            losses=losses,
            task_norms=norms,
            cosine=cosine,
            cosine_to_update=cos_update,
            update_norm=update_norm,
            weights=result.weights,
            found_inf=not finite,
            loss_scale=None if scale is None else float(scale),
            pre_clip_norms=pre_clip,
            num_backward=count,
        )

    def _write_back(self, vector: Tensor, scale: Tensor | None) -> None:
        if scale is not None:
            vector = vector * scale.to(vector.dtype)
        for p, start, stop in self.layout.slices():
            part = vector[start:stop].view_as(p)
            if p.grad is None:
                p.grad = part.clone()
            else:
                p.grad.add_(part)

    @property
    def matrix(self) -> Tensor | None:
        """The accumulated ``[K, P]`` task gradients (scaled, if a scaler was given), or None."""
        return self._matrix if self._count > 0 else None

    def reset(self) -> None:
        """Drop the accumulated gradients of the current step (keeps the buffer's memory)."""
        self._count = 0
        self._losses = None


def balanced_backward(
    losses: Tensor | Sequence[Tensor],
    balancer: Balancer,
    *,
    shared_params: Iterable[Tensor],
    head_params: Iterable[Tensor] | None = None,
    scaler: Any = None,
    clip: RowClipper | None = None,
    strategy: Strategy = "auto",
) -> StepStats:
    """One-shot balanced backward for a single micro-batch.

    Equivalent to ``TaskGradBuffer(...).backward(losses)`` then ``.apply_(balancer)``. For a
    loop, keep a :class:`TaskGradBuffer` instead: it reuses its ``[K, P]`` buffer.
    """
    buf = TaskGradBuffer(shared_params, head_params, strategy=strategy,
                         num_tasks=balancer.num_tasks)
    buf.backward(losses, scaler=scaler)
    return buf.apply_(balancer, scaler=scaler, clip=clip)
