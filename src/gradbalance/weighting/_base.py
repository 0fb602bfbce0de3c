"""The loss-weighting interface: weighted per-task losses before the backward pass
(docs/weighting.md, "The contract")."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from .._checks import (
    GLOBAL_LOSSES_TAG,
    UNDO_OBSERVATION_TAG,
    as_loss_vector,
    check_device,
    check_int,
    check_num_tasks,
)
from .._module import StateModule
from .._types import NonFiniteGradientError

__all__ = ["LossWeighting"]


def _as_flag(found_inf: bool | Tensor) -> bool:
    if isinstance(found_inf, Tensor):
        return bool(found_inf.detach().ne(0).any())
    # numpy's bool_ is not an int
    if not isinstance(found_inf, (bool, int)) and type(found_inf).__name__ != "bool_":
        raise ValueError(f"Invalid found_inf: {found_inf!r} (expected a bool or a tensor: "
                         f"True when the optimizer step was skipped, e.g. stats.found_inf)")
    return bool(found_inf)


#: The classes :func:`_warn_if_rank_losses` has warned about in this process.
_WARNED: set[str] = set()


def _warn_if_rank_losses(weighting: LossWeighting, losses: object) -> None:
    """Warn once per class where a weighting that reads the losses' values is called, under
    a process group of several ranks, with losses not from
    :func:`~gradbalance.distributed.global_losses` (each rank would weight its shard by its
    own losses: not the single-process step)."""
    name = type(weighting).__name__
    if name in _WARNED or getattr(losses, GLOBAL_LOSSES_TAG, False):
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    _WARNED.add(name)
    warnings.warn(
        f"{name} weights the losses by their values in the call, and this rank's losses "
        f"are its own shard's: the ranks' averaged step is not the single-process step on "
        f"the global batch. Pass gradbalance.distributed.global_losses(losses) (the global "
        f"batch's values, this rank's gradients; the integrations do this themselves)",
        stacklevel=3,
    )


class LossWeighting(StateModule):
    """Base class of every loss weighting.

    A subclass declares ``name`` (registry key), ``needs_task_gradients`` (the call computes
    task gradients, as GradNorm), ``learnable`` (:meth:`parameters` are for the *user's*
    optimizer), ``_pending_state`` and its state with :meth:`register_state`: the rules of
    docs/ARCHITECTURE.md, "Extension contract".

    Args:
        num_tasks: K; every call checks it.
        device: where the state tensors live (default CPU); use the losses' device.

    Example:
        >>> import torch
        >>> from gradbalance.weighting import LossWeighting, ScaleInvariant
        >>> weighting = ScaleInvariant(2)  # a LossWeighting: call, step, then update()
        >>> isinstance(weighting, LossWeighting), weighting(torch.tensor([2.0, 4.0]))
        (True, tensor([1., 1.]))
        >>> weighting.update()
        True
    """

    name: ClassVar[str] = ""
    needs_task_gradients: ClassVar[bool] = False
    learnable: ClassVar[bool] = False
    _kind = "weighting"
    _extra_keys: ClassVar[tuple[str, ...]] = ("num_tasks",)
    _repr_args: ClassVar[tuple[str, ...]] = ("num_tasks",)
    #: The state that :attr:`weights` returns (empty: the class implements :attr:`weights`).
    _weights_state: ClassVar[str] = ""
    #: Attributes holding what a step gathers besides the losses for :meth:`update` (None
    #: between steps): :meth:`pending_tensors` returns them, a skipped step drops them.
    _pending_state: ClassVar[tuple[str, ...]] = ()
    #: Whether the weights (or the objective) depend on the values of the losses of the call,
    #: not only on state: data-parallel ranks must pass the global batch's values
    #: (:func:`~gradbalance.distributed.global_losses`) for the single-process step.
    reads_losses: ClassVar[bool] = False
    #: Whether :meth:`update` needs ``losses_after``, the same batch's losses after the
    #: optimizer step (FAMO), which a loop must compute itself.
    needs_losses_after: ClassVar[bool] = False

    def __init__(self, num_tasks: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.num_tasks: int = check_num_tasks("num_tasks", num_tasks)
        self.device = torch.device("cpu") if device is None else check_device("device", device)
        self._pending: Tensor | None = None
        self._observation = 0  # counts the pending observations dropped or learned from

    # -- to implement -------------------------------------------------------------------
    def _weighted(self, losses: Tensor, *args: Any) -> Tensor:
        """Weighted per-task losses ``[K]`` from the checked loss vector."""
        raise NotImplementedError

    def _apply_update(self, losses: Tensor, losses_after: Tensor | None) -> None:
        """Change the state from this step's (finite, summed) losses; default: nothing."""

    def _discard_pending(self) -> None:
        """Drop the pending observation: the losses and :attr:`_pending_state`."""
        self._pending = None
        for name in self._pending_state:
            setattr(self, name, None)
        self._observation += 1  # an earlier call's undo no longer applies

    @property
    def weights(self) -> Tensor:
        """The current task weights ``[K]`` (a detached copy), for logging."""
        if not self._weights_state:
            raise NotImplementedError(f"{type(self).__name__} must implement weights")
        state: Tensor = getattr(self, self._weights_state)
        return state.detach().clone()

    # -- public -------------------------------------------------------------------------
    def forward(self, losses: Tensor | Sequence[Tensor], *, scaler: Any = None,
                micro_batches: int = 1) -> Tensor:
        """Weighted task losses ``[K]`` (same dtype as ``losses``, graph kept).

        Called as ``weighting(losses)``, ``losses`` the K task losses (a 1-D tensor or a list
        of scalars); ``scaler``: the loop's ``GradScaler`` (read by GradNorm only). The detached
        losses join the pending observation of :meth:`update`; inf/NaN losses do not raise
        here (the scaler skips the step). ``micro_batches=M``: ``losses`` are one of the
        step's M micro-batches' (each its mean, undivided); the call returns its share of the
        step's objective, ``f(L)/M``, and observes ``L/M`` (GradNorm: its layer gradients
        ``/M``), so the M calls give the full batch's gradient and state for every method
        whose weights do not read the call's losses (docs/weighting.md, "Micro-batches").

        Example:
            >>> import torch
            >>> from gradbalance.weighting import UncertaintyWeighting
            >>> u = UncertaintyWeighting(2)
            >>> halves = [u(torch.tensor([2.0, 4.0]), micro_batches=2),
            ...           u(torch.tensor([4.0, 8.0]), micro_batches=2)]
            >>> sum(halves).detach(), u(torch.tensor([3.0, 6.0])).detach()  # the full batch
            (tensor([1.5000, 3.0000]), tensor([1.5000, 3.0000]))
        """
        share = 1.0 / check_int("micro_batches", micro_batches, 1,
                                ", the number of micro-batches of the step")
        if self.reads_losses:
            _warn_if_rank_losses(self, losses)
        vector = as_loss_vector("losses", losses, self.num_tasks)
        if not vector.is_floating_point():
            raise ValueError(f"losses must be floating point, got dtype {vector.dtype}")
        mark = self._pending_mark()  # before the call gathers anything (GradNorm's layer)
        out = self._weighted(vector, scaler, share) if self.needs_task_gradients else \
            self._weighted(vector)
        detached = vector.detach().to(device=self.device, dtype=torch.float64)
        if micro_batches > 1:
            out, detached = out * share, detached * share
        setattr(out, UNDO_OBSERVATION_TAG, _Undo(self, mark))
        self._pending = detached if self._pending is None else self._pending + detached
        return out

    def _pending_mark(self) -> tuple[int, Tensor | None, tuple[Tensor | None, ...]]:
        """The pending observation as it is (its tensors are replaced, never changed in
        place, by later calls)."""
        return (self._observation, self._pending,
                tuple(getattr(self, name) for name in self._pending_state))

    def _undo_observation(self, mark: tuple[int, Tensor | None,
                                            tuple[Tensor | None, ...]]) -> None:
        """Back to :meth:`_pending_mark`'s observation, unless it was dropped or learned
        from since (:meth:`update`, :meth:`reset`, a load)."""
        observation, pending, gathered = mark
        if observation != self._observation:
            return
        self._pending = pending
        for name, value in zip(self._pending_state, gathered, strict=True):
            setattr(self, name, value)

    def update(
        self, losses_after: Tensor | Sequence[Tensor] | None = None, *,
        found_inf: bool | Tensor = False,
    ) -> bool:
        """Learn from the step just taken; call once per optimizer step, after it.

        ``losses_after``: the same batch's task losses after the step (FAMO only).
        ``found_inf``: True when the optimizer step was skipped (e.g. ``scaler.get_scale() <
        scale_before``): the pending observation is dropped, the state bit-identical. Returns
        True when the state was updated; ``NonFiniteGradientError`` (state unchanged) for
        inf/NaN losses of a step not skipped.
        """
        pending = self._pending
        skipped = _as_flag(found_inf)
        after = None
        if not skipped and pending is not None:  # a refused argument keeps the observation:
            if losses_after is not None:        # the call can be repeated
                after = as_loss_vector("losses_after", losses_after, self.num_tasks)
                after = after.detach().to(device=self.device, dtype=torch.float64)
            self._check_update(after)
        try:
            if skipped:
                return False
            if pending is None:
                raise RuntimeError(
                    f"{type(self).__name__}.update() called without a weighting call since "
                    f"the last update; call weighting(losses) every step before the optimizer "
                    f"step"
                )
            if not all(bool(torch.isfinite(t).all()) for t in (pending, after) if t is not None):
                raise NonFiniteGradientError(
                    f"the losses of this step hold inf or NaN ({pending.tolist()}); "
                    f"{type(self).__name__} state is unchanged. Pass found_inf=True for a "
                    f"skipped step, or find the source of the overflow"
                )
            if self.learnable:
                self._warn_if_no_grad()
            self._apply_update(pending, after)
            return True
        finally:
            self._discard_pending()

    def _check_update(self, losses_after: Tensor | None) -> None:
        """Raise for arguments of :meth:`update` this method refuses, before anything moves
        (the pending observation kept); FAMO's ``losses_after``."""

    def pending_tensors(self) -> list[Tensor]:
        """The pending observation of this step: what :meth:`update` will learn from.

        The summed detached losses ``[K]`` (float64) and what a method gathers besides
        (GradNorm: its layer's ``[K, P_layer]`` gradients), in the same order on every process;
        data-parallel training averages them in place (:func:`~gradbalance.sync_weighting_`).
        """
        gathered = [getattr(self, name) for name in self._pending_state]
        return [t for t in [self._pending, *gathered] if t is not None]

    # -- state ----------------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        return {"num_tasks": self.num_tasks}

    def _check_state(self, tensors: dict[str, Tensor | None], extra: dict[str, Any]) -> None:
        k = extra.get("num_tasks")
        if k != self.num_tasks:
            raise ValueError(
                f"state_dict was saved with num_tasks={k!r} but this {type(self).__name__} has "
                f"num_tasks={self.num_tasks}; build it with the same number of tasks"
            )
        super()._check_state(tensors, extra)

    def _load_extra(self, extra: dict[str, Any]) -> None:
        """A loaded state starts a new step: the pending observation is dropped."""
        self._discard_pending()

    def _state_device(self) -> torch.device:
        return self.device

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        """``.to()``, ``.double()``...: ``device`` follows the state."""
        out = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        for tensor in [*self._parameters.values(), *self._buffers.values()]:
            if tensor is not None:
                self.device = tensor.device
                break
        return out

    def reset(self) -> None:
        """Forget all state (as freshly built); learnable tensors are reset in place."""
        self._discard_pending()
        super().reset()

    # -- helpers ------------------------------------------------------------------------
    def _warn_if_no_grad(self) -> None:
        if getattr(self, "_warned_no_grad", False):
            return
        if any(p.grad is None for p in self.parameters()):
            self._warned_no_grad = True
            warnings.warn(
                f"{type(self).__name__}'s learnable parameters have no gradient at update(): "
                f"add weighting.parameters() to your optimizer (and to head_params of a "
                f"TaskGradBuffer), and call update() before optimizer.zero_grad()",
                RuntimeWarning, stacklevel=3,
            )



def times_weights(weights: Tensor, losses: Tensor) -> Tensor:
    """``wₖ Lₖ`` in the dtype and on the device of ``losses``, the graph kept; the product
    of float16 or bfloat16 losses taken in float32 (a weight past float16's range, ``1/Lₖ``
    of a loss near 0, cast first, gave ``inf · 0 = NaN``).

    Example:
        >>> import torch
        >>> from gradbalance.weighting._base import times_weights
        >>> times_weights(torch.tensor([1e12, 1.0], dtype=torch.float64),
        ...               torch.tensor([0.0, 2.0], dtype=torch.float16))
        tensor([0., 2.], dtype=torch.float16)
    """
    if losses.dtype in (torch.float16, torch.bfloat16):
        wide = weights.to(dtype=torch.float32, device=losses.device) * losses.float()
        return wide.to(losses.dtype)
    return weights.to(dtype=losses.dtype, device=losses.device) * losses


class _Undo:
    """The undo a weighting call tags its output with (``UNDO_OBSERVATION_TAG``): the
    weighting (weakly: a tag must not keep it alive) and its observation before the call."""

    def __init__(self, weighting: LossWeighting,
                 mark: tuple[int, Tensor | None, tuple[Tensor | None, ...]]) -> None:
        self._weighting = weakref.ref(weighting)
        self._mark = mark

    def __call__(self) -> None:
        weighting = self._weighting()
        if weighting is not None:
            weighting._undo_observation(self._mark)
