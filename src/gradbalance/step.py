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
from .distributed import (
    all_ranks_true,
    all_reduce_grads_and_losses_,
    all_reduce_step_,
    resolve_process_group,
)
from .gramian import compute_gramian, is_finite_gramian
from .modes import GramianRecorder, Mode, WeightCache, check_mode
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


def _grads_finite(params: Sequence[Tensor]) -> Tensor:
    """True (0-d bool tensor) when every existing ``.grad`` of ``params`` is finite."""
    flags = [torch.isfinite(p.grad).all() for p in params if p.grad is not None]
    if not flags:
        return torch.ones((), dtype=torch.bool)
    return torch.stack([f.to(flags[0].device) for f in flags]).all()


class TaskGradBuffer:
    """Accumulates per-task gradients of the shared parameters and balances them once.

    Args:
        shared_params: the trunk's parameters (all must require grad).
        head_params: task-specific parameters; they receive their plain gradient of the
            summed losses (the PCGrad paper's rule), accumulated with ``+=``.
        num_tasks: K, checked on every call; inferred from the first ``backward`` if None.
        strategy: ``"auto"``, ``"loop"`` or ``"batched"`` (see :mod:`gradbalance.taskgrads`).
        process_group: data parallelism: ``G``, the heads' ``.grad`` and the losses are
            averaged over its ranks in ``apply_`` before balancing (None: the default group
            when torch.distributed is initialised; ``"local"``: off). See
            :mod:`gradbalance.distributed`.
        mode: ``"matrix"`` (default, ``[K, P]``), ``"gramian"`` (``G Gᵀ`` only, weighted
            balancers, needs ``modules``) or ``"features"`` (gradients w.r.t. the trunk's
            output, a different method; pass ``features=`` to :meth:`backward`). See
            :mod:`gradbalance.modes`.
        update_every: recompute a weighted balancer's weights every this many steps and reuse
            them in between with one backward of ``Σₖ wₖ Lₖ`` (1: every step).
        modules: for ``mode="gramian"``, the module(s) owning ``shared_params`` (the trunk).

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
        process_group: Any = None,
        mode: Mode = "matrix",
        update_every: int = 1,
        modules: Any = None,
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
        self.process_group = process_group
        self.mode: Mode = check_mode(mode)  # type: ignore[assignment]
        self._cache = WeightCache(update_every)
        self.update_every = update_every
        self._recorder: GramianRecorder | None = None
        if mode == "gramian":
            if modules is None:
                raise ValueError(
                    "mode='gramian' needs modules=...: the module(s) owning shared_params, "
                    "e.g. TaskGradBuffer(..., mode='gramian', modules=model.trunk)"
                )
            self._recorder = GramianRecorder(modules, shared)
        self._features: Tensor | None = None
        self._reused = False

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
        yourself if you want their average). With a ``GradScaler``, pass it here and to
        :meth:`apply_`; the scaled losses are backpropagated, as ``scaler.scale`` would.
        ``features``: the shared representation the heads read (``mode="features"`` only).
        In ``gramian`` and ``features`` modes a step takes one ``backward`` (the Gramian of a
        sum of micro-batches is not the sum of their Gramians); on a step that reuses cached
        weights (``update_every``) any number of micro-batches work.
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

        if features is not None and self.mode != "features":
            raise ValueError(
                f"features is only used with mode='features' (this buffer has "
                f"mode={self.mode!r}); drop the argument or build the buffer with that mode"
            )
        first = self._count == 0
        if first:
            self._reused = self._cache.reuse_now()
        if self._reused:
            self._backward_weighted(scaled)
        elif self.mode == "matrix":
            if self._matrix is None or self._matrix.shape[0] != k:
                self._matrix = torch.empty(
                    k, self.layout.numel, dtype=self.layout.dtype, device=self.layout.device
                )
            if self.head_params:
                torch.autograd.backward(scaled.sum(), inputs=self.head_params,
                                        retain_graph=True)
            compute_into(scaled, self.layout, self._matrix, strategy=self.strategy,
                         accumulate=not first, retain_graph=False)
        else:
            self._backward_once(scaled, features)
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
        (or, with a scaler, a head's ``.grad``) holds inf/NaN: with a scaler, the plain sum
        is written so the scaler skips the step and the balancer is not called; without one,
        ``NonFiniteGradientError`` is raised and ``.grad`` of the trunk is left unchanged.
        """
        if self._count == 0 or self._losses is None:
            raise RuntimeError(
                "apply_() called before any backward(); call buf.backward(losses) for each "
                "micro-batch first"
            )
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
        if self._reused or self.mode != "matrix":
            return self._apply_mode(balancer, clip)
        matrix, losses, scale, count = self._matrix, self._losses, self._scale, self._count
        assert matrix is not None
        self._count = 0  # the buffer is free again whatever happens below
        group = resolve_process_group(self.process_group)
        if group is not None:  # mean over the ranks, before unscaling and balancing
            losses = all_reduce_step_(matrix, losses, self.head_params, group)
        if scale is not None:
            matrix.div_(scale.to(matrix.dtype))
        gram = compute_gramian(matrix)
        finite_flag = is_finite_gramian(gram)
        if scale is not None and self.head_params:  # the scaler will skip: change no state
            finite_flag = finite_flag & _grads_finite(self.head_params)
        if group is not None:  # every rank skips the same steps
            finite_flag = all_ranks_true(finite_flag, group)
        finite = bool(finite_flag)
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
            self._cache.refreshed(result.weights)
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

    # -- other modes and amortised steps (see gradbalance.modes) ---------------------------
    def _backward_weighted(self, scaled: Tensor) -> None:
        """A step reusing cached weights: heads get ``Σ Lₖ``, the trunk ``Σ wₖ Lₖ``."""
        weights = self._cache.weights
        assert weights is not None
        if self.head_params:
            torch.autograd.backward(scaled.sum(), inputs=self.head_params, retain_graph=True)
        total = (weights.to(dtype=scaled.dtype, device=scaled.device) * scaled).sum()
        torch.autograd.backward(total, inputs=self.layout.params)

    def _backward_once(self, scaled: Tensor, features: Tensor | None) -> None:
        """``gramian`` / ``features`` mode: task gradients of one micro-batch, kept lazily."""
        if self._count > 0:
            raise ValueError(
                f"mode={self.mode!r} takes one backward() per step (the Gramian of a sum of "
                f"micro-batches is not the sum of their Gramians); call apply_() after each "
                f"backward(), or use mode='matrix' to accumulate micro-batches"
            )
        if resolve_process_group(self.process_group) is not None:
            raise ValueError(
                f"mode={self.mode!r} does not reduce over data-parallel ranks; use "
                f"mode='matrix' or process_group='local'"
            )
        if self.mode == "features" and (
            not isinstance(features, Tensor) or not features.requires_grad
        ):
            raise ValueError(
                "mode='features' needs features=<the trunk's output tensor> (requiring "
                "grad), e.g. feats = model.trunk(x); buf.backward(losses, features=feats)"
            )
        batched = resolve_strategy(self.strategy, self.layout.device) == "batched"
        if self._recorder is not None:
            if self.head_params:
                torch.autograd.backward(scaled.sum(), inputs=self.head_params,
                                        retain_graph=True)
            self._recorder.task_output_grads(scaled, batched)
            return
        assert features is not None
        layout = ParamLayout([features])
        k = scaled.shape[0]
        if self._matrix is None or self._matrix.shape != (k, layout.numel) or (
            self._matrix.dtype != layout.dtype
        ):
            self._matrix = torch.empty(k, layout.numel, dtype=layout.dtype, device=layout.device)
        self._features = features
        if batched:
            if self.head_params:
                torch.autograd.backward(scaled.sum(), inputs=self.head_params,
                                        retain_graph=True)
            compute_into(scaled, layout, self._matrix, strategy=self.strategy, retain_graph=True)
            return
        # The loop: each pass through the heads also yields the heads' plain gradients.
        heads: list[Tensor | None] = [None] * len(self.head_params)
        for task in range(k):
            grads = torch.autograd.grad(scaled[task], [features, *self.head_params],
                                        retain_graph=True, allow_unused=True)
            self._matrix[task].copy_(grads[0].reshape(-1))
            for j, g in enumerate(grads[1:]):
                if g is not None:
                    total = heads[j]
                    heads[j] = g if total is None else total.add_(g)
        for p, g in zip(self.head_params, heads):
            if g is not None:
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)

    def _apply_mode(self, balancer: Balancer, clip: RowClipper | None) -> StepStats:
        losses, scale, count = self._losses, self._scale, self._count
        assert losses is not None
        self._count = 0
        if self._reused:
            self._cache.reused()
            group = resolve_process_group(self.process_group)
            if group is not None:  # the weighted backward wrote each rank's own gradients
                losses = all_reduce_grads_and_losses_(
                    [*self.layout.params, *self.head_params], losses, group)
            return StepStats(losses=losses, task_norms=None, cosine=None, cosine_to_update=None,
                             update_norm=None, weights=self._cache.weights,
                             loss_scale=None if scale is None else float(scale),
                             num_backward=count, weights_reused=True)
        if clip is not None:
            raise ValueError(
                f"clip needs the task-gradient rows of mode='matrix'; this buffer has "
                f"mode={self.mode!r}"
            )
        features, self._features = self._features, None
        recorder = self._recorder
        try:
            if recorder is not None:
                if not balancer.from_gramian:
                    raise TypeError(
                        f"{type(balancer).__name__} needs the task-gradient rows, not only the "
                        f"Gramian; use mode='matrix' (or 'features')"
                    )
                gram = recorder.gramian(losses.shape[0], losses.device)
                matrix = None
            else:
                matrix = self._matrix
                assert matrix is not None and features is not None
                gram = compute_gramian(matrix)
            if scale is not None:
                gram = gram / scale.double() ** 2
                if matrix is not None:
                    matrix.div_(scale.to(matrix.dtype))
            finite = bool(is_finite_gramian(gram))
            if not finite and scale is None:
                raise NonFiniteGradientError(
                    "task gradients hold inf or NaN (no GradScaler given); the trunk's .grad "
                    "and the balancer's state are unchanged. Skip this optimizer step "
                    "(optimizer.zero_grad()) or find the source of the overflow"
                )
            k = losses.shape[0]
            if matrix is None:  # gramian mode: weights, then one product per block
                assert recorder is not None
                weights = balancer.weights_checked(gram, losses) if finite else torch.ones(
                    k, dtype=torch.float64, device=gram.device)
                recorder.write_weighted_(weights)
                vector = None
            else:  # features mode: combine the feature gradients, backpropagate once
                result = (balancer.combine(matrix, losses, gramian=gram) if finite
                          else Combination(matrix.sum(dim=0)))
                weights, vector = result.weights, result.vector
                grad = vector if scale is None else vector * scale.to(vector.dtype)
                assert features is not None
                torch.autograd.backward(features, grad.view_as(features).to(features.dtype),
                                        inputs=self.layout.params)
        finally:
            if recorder is not None:
                recorder.clear()
        if finite:
            self._cache.refreshed(weights)
            if weights is None:
                assert matrix is not None and vector is not None
            norms, cosine, cos_update, update_norm = stats_from_gramian(
                gram, losses, matrix, vector, weights
            )
        else:
            nan = torch.full((k,), float("nan"), dtype=torch.float64, device=gram.device)
            norms, cosine, cos_update, update_norm = (
                torch.diagonal(gram).sqrt(), nan[:, None] * nan, nan, nan[0])
        return StepStats(
            losses=losses, task_norms=norms, cosine=cosine, cosine_to_update=cos_update,
            update_norm=update_norm, weights=weights if finite else None, found_inf=not finite,
            loss_scale=None if scale is None else float(scale), num_backward=count,
            mode=self.mode,
        )

    def state_dict(self) -> dict[str, Any]:
        """The ``update_every`` counter and cached weights (the ``[K, P]`` buffer is transient)."""
        return self._cache.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; works on a freshly built buffer."""
        self._cache.load_state_dict(state_dict)

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
        """Drop the current step and the cached weights (keeps the buffer's memory)."""
        self._count = 0
        self._losses = None
        self._features = None
        self._reused = False
        self._cache.reset()
        if self._recorder is not None:
            self._recorder.clear()


def balanced_backward(
    losses: Tensor | Sequence[Tensor],
    balancer: Balancer,
    *,
    shared_params: Iterable[Tensor],
    head_params: Iterable[Tensor] | None = None,
    scaler: Any = None,
    clip: RowClipper | None = None,
    strategy: Strategy = "auto",
    mode: Mode = "matrix",
    modules: Any = None,
    features: Tensor | None = None,
) -> StepStats:
    """One-shot balanced backward for a single micro-batch.

    Equivalent to ``TaskGradBuffer(...).backward(losses, features=features)`` then
    ``.apply_(balancer)``. For a loop, keep a :class:`TaskGradBuffer` instead: it reuses its
    ``[K, P]`` buffer, keeps ``update_every``'s cached weights, and in ``gramian`` mode
    registers its forward hooks once (build it before the forward).
    """
    if mode == "gramian":
        raise ValueError(
            "balanced_backward cannot use mode='gramian': its forward hooks must exist before "
            "the forward. Build TaskGradBuffer(..., mode='gramian', modules=model.trunk) once, "
            "before the training loop, and call buf.backward(losses); buf.apply_(balancer)"
        )
    buf = TaskGradBuffer(shared_params, head_params, strategy=strategy,
                         num_tasks=balancer.num_tasks, mode=mode, modules=modules)
    buf.backward(losses, scaler=scaler, features=features)
    return buf.apply_(balancer, scaler=scaler, clip=clip)
