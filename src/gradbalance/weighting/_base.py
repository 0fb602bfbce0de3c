"""The loss-weighting interface: weighted per-task losses before the backward pass.

A loss weighting maps the K task losses to K *weighted* task losses (docs/weighting.md: weights
act before the backward passes and change a task gradient's length, never its direction)::

    weighted = weighting(losses)            # Tensor[K], keeps the graph
    weighted.sum().backward()               # plain loop: one backward pass
    # or: buf.backward(weighted); buf.apply_(Sum())   # any gradient balancer
    optimizer.step()
    weighting.update(found_inf=skipped)     # methods that learn from the step

The sum of the returned vector has the method's gradient. Entry ``k`` depends on ``L_k`` only
(plus the method's own learnable parameters), so the per-task gradient rows a
:class:`~gradbalance.TaskGradBuffer` computes from it are ``wₖ ∇Lₖ``.

Every call adds the detached losses into a *pending* observation (summed over the calls of
one step, i.e. over micro-batches); :meth:`LossWeighting.update` consumes it once per optimizer
step. A skipped step (``found_inf=True``) discards it and leaves every state tensor
bit-identical; a non-finite observation on a step said not to be skipped raises
:class:`~gradbalance.NonFiniteGradientError` before any change.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._checks import as_loss_vector, check_num_tasks
from .._pickling import PicklableGenerators
from .._statedict import check_keys, reject_state, tag_state, untag_state
from .._types import NonFiniteGradientError

__all__ = ["LossWeighting"]


def _as_flag(found_inf: bool | Tensor) -> bool:
    if isinstance(found_inf, Tensor):
        return bool(found_inf.detach().ne(0).any())
    return bool(found_inf)


class LossWeighting(PicklableGenerators):
    """Base class of every loss weighting.

    Class attributes a subclass declares:

    * ``name``: registry key (lower case).
    * ``needs_task_gradients``: the call itself computes per-task gradients (GradNorm's norms
      at one layer); all other methods cost no extra backward pass.
    * ``learnable``: :meth:`parameters` returns tensors the *user's* optimizer must step
      (Uncertainty Weighting, IMTL-L).

    Args:
        num_tasks: K; every call checks it.
        device: where the state tensors live (default CPU); use the losses' device.
    """

    name: ClassVar[str] = ""
    needs_task_gradients: ClassVar[bool] = False
    learnable: ClassVar[bool] = False

    def __init__(self, num_tasks: int, *, device: torch.device | str | None = None) -> None:
        self.num_tasks: int = check_num_tasks("num_tasks", num_tasks)
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._pending: Tensor | None = None
        self._pending_calls = 0

    # -- to implement -------------------------------------------------------------------
    def _weighted(self, losses: Tensor, *args: Any) -> Tensor:
        """Weighted per-task losses ``[K]`` from the checked loss vector."""
        raise NotImplementedError

    def _apply_update(self, losses: Tensor, losses_after: Tensor | None) -> None:
        """Change the state from this step's (finite, summed) losses; default: nothing."""

    def _state(self) -> dict[str, Any]:
        return {}

    def _load_state(self, state: dict[str, Any]) -> None:
        reject_state(type(self).__name__, state, "weighting")

    def _reset_state(self) -> None:
        """Back to the state at construction."""

    def _discard_pending(self) -> None:
        """Drop per-step data a subclass gathers besides the losses (GradNorm's gradients)."""

    @property
    def weights(self) -> Tensor:
        """The current task weights ``[K]`` (detached), for logging."""
        raise NotImplementedError

    # -- public -------------------------------------------------------------------------
    def __call__(self, losses: Tensor | Sequence[Tensor], *, scaler: Any = None) -> Tensor:
        """Weighted task losses ``[K]`` (same dtype as ``losses``, graph kept).

        ``losses`` are the K task losses (batch means), a 1-D tensor or a list of scalars.
        ``scaler``: the ``GradScaler`` of the loop; methods that take task gradients
        (``needs_task_gradients``) use it to unscale them, the others ignore it.
        The detached losses are added to the pending observation that :meth:`update` uses.
        Non-finite losses are not an error here: they make the result (and the gradient)
        non-finite, so a ``GradScaler`` skips the step; :meth:`update` then refuses them.
        """
        vector = as_loss_vector("losses", losses, self.num_tasks)
        if not vector.is_floating_point():
            raise ValueError(f"losses must be floating point, got dtype {vector.dtype}")
        out = self._weighted(vector, scaler) if self.needs_task_gradients else \
            self._weighted(vector)
        detached = vector.detach().to(device=self.device, dtype=torch.float64)
        self._pending = detached if self._pending is None else self._pending + detached
        self._pending_calls += 1
        return out

    def update(
        self, losses_after: Tensor | Sequence[Tensor] | None = None, *,
        found_inf: bool | Tensor = False,
    ) -> bool:
        """Learn from the step just taken; call once per optimizer step, after it.

        Args:
            losses_after: the same batch's task losses after the step (FAMO only; other
                methods ignore it).
            found_inf: True when the optimizer step was skipped (e.g.
                ``scaler.get_scale() < scale_before``); the pending observation is then
                dropped and the state stays bit-identical.

        Returns:
            True when the state was updated.

        Raises:
            NonFiniteGradientError: the step's losses (or ``losses_after``) hold inf/NaN and
                ``found_inf`` is False; the state is unchanged.
        """
        pending, calls = self._pending, self._pending_calls
        self._pending, self._pending_calls = None, 0
        if _as_flag(found_inf):
            self._discard_pending()
            return False
        if pending is None or calls == 0:
            raise RuntimeError(
                f"{type(self).__name__}.update() called without a weighting call since the "
                f"last update; call weighting(losses) every step before the optimizer step"
            )
        after = None
        if losses_after is not None:
            after = as_loss_vector("losses_after", losses_after, self.num_tasks)
            after = after.detach().to(device=self.device, dtype=torch.float64)
        bad = not bool(torch.isfinite(pending).all())
        if after is not None and not bool(torch.isfinite(after).all()):
            bad = True
        if bad:
            self._discard_pending()
            raise NonFiniteGradientError(
                f"the losses of this step hold inf or NaN ({pending.tolist()}); "
                f"{type(self).__name__} state is unchanged. Pass found_inf=True for a skipped "
                f"step, or find the source of the overflow"
            )
        if self.learnable:
            self._warn_if_no_grad()
        try:
            self._apply_update(pending, after)
        finally:
            self._discard_pending()
        return True

    def parameters(self) -> list[Tensor]:
        """Tensors the user's optimizer must step (empty unless ``learnable``)."""
        return []

    def pending_tensors(self) -> list[Tensor]:
        """The pending observation of this step: what :meth:`update` will learn from.

        The summed detached losses ``[K]`` (float64) and whatever a method gathers besides
        (GradNorm: the ``[K, P_layer]`` gradients at its layer); empty before the step's first
        call. The list order is the same on every process. Changing the tensors in place
        changes what :meth:`update` sees: data-parallel training averages them over the ranks
        (:func:`~gradbalance.sync_weighting_`), so that every rank learns from the full batch.
        """
        return [] if self._pending is None else [self._pending]

    def state_dict(self) -> dict[str, Any]:
        """Every tensor needed to resume (copies), ``num_tasks`` and ``"_type"`` (the class)."""
        state = copy.deepcopy(self._state())
        state["num_tasks"] = self.num_tasks
        return tag_state(self, state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output into this (possibly fresh) object.

        Raises ``ValueError`` for a state saved by another class, with unknown keys or for
        another ``num_tasks``; a load that fails changes nothing.
        """
        state = untag_state(self, state_dict, "weighting")
        k = state.pop("num_tasks", None)
        if k != self.num_tasks:
            raise ValueError(
                f"state_dict was saved with num_tasks={k!r} but this {type(self).__name__} has "
                f"num_tasks={self.num_tasks}; build it with the same number of tasks"
            )
        check_keys(type(self).__name__, state, self._state(), kind="weighting")
        before = copy.deepcopy(self._state())
        try:
            self._load_state(copy.deepcopy(state))
        except BaseException:
            self._load_state(before)
            raise
        self._pending, self._pending_calls = None, 0
        self._discard_pending()

    def reset(self) -> None:
        """Forget all state (as freshly built); learnable tensors are reset in place."""
        self._pending, self._pending_calls = None, 0
        self._discard_pending()
        self._reset_state()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_tasks={self.num_tasks})"

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

    def _check_state_tensor(self, state: dict[str, Any], key: str,
                            shape: tuple[int, ...]) -> Tensor:
        if key not in state:
            raise ValueError(
                f"state_dict lacks {key!r}; was it saved from another {type(self).__name__}?"
            )
        value = state[key]
        if not isinstance(value, Tensor) or tuple(value.shape) != shape:
            found = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise ValueError(f"state_dict[{key!r}] must be a tensor of shape {shape}, got {found}")
        return value.to(self.device)
