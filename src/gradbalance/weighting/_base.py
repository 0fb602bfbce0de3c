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

A loss weighting is a ``torch.nn.Module`` (``weighting(losses)`` is :meth:`LossWeighting.forward`):
its tensor state is in buffers, Python counters, generator and internal optimizer states and
the class name in its extra state (:mod:`gradbalance._module`), so attached to a model it is in
``model.state_dict()`` and moves with ``model.to()``. Weights the *user's* optimizer trains
(Uncertainty Weighting, IMTL-L) are ``nn.Parameter`` and appear in ``model.parameters()``;
weights a method steps itself in :meth:`LossWeighting.update` (GradNorm's ``w``, FAMO's ``ξ``)
are buffers, hidden from ``parameters()``, so no user optimizer steps them a second time.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._checks import as_loss_vector, check_num_tasks
from .._module import StateModule
from .._types import NonFiniteGradientError

__all__ = ["LossWeighting"]


def check_optimizer_state(make: Callable[[Tensor], torch.optim.Optimizer], param: Tensor,
                          state: Any, owner: str) -> None:
    """Raise ``ValueError`` unless ``state`` loads into an optimizer like ``owner``'s own.

    Loaded into a scratch optimizer built on a copy of ``param``: nothing of ``owner`` moves.
    Its moments must have ``param``'s shape (one entry per task) and be finite.
    """
    if not isinstance(state, dict):
        raise ValueError(f"state_dict lacks 'optimizer' (the state of {owner}'s own "
                         f"optimizer); was it saved from another {owner}?")
    scratch = make(param.detach().clone().requires_grad_(True))
    try:
        scratch.load_state_dict(copy.deepcopy(state))
    except (ValueError, KeyError, TypeError, RuntimeError) as error:
        raise ValueError(f"state_dict['optimizer'] does not load into {owner}'s optimizer "
                         f"({error}); was it saved with another optimizer?") from error
    for entries in scratch.state.values():
        for key, value in entries.items():
            _check_moment(owner, key, value, param)


def _check_moment(owner: str, key: str, value: Any, param: Tensor) -> None:
    """Raise ``ValueError`` for an optimizer state entry of another shape than ``param``'s
    (another number of tasks) or holding inf/NaN."""
    if not isinstance(value, Tensor):
        return
    if value.dim() > 0 and value.shape != param.shape:
        raise ValueError(f"state_dict['optimizer'] holds {key!r} of shape {tuple(value.shape)} "
                         f"but {owner} trains {tuple(param.shape)} (one entry per task); load "
                         f"a state saved with the same number of tasks")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise ValueError(f"state_dict['optimizer'][{key!r}] holds inf/NaN; the state was saved "
                         f"after a failed step or damaged: load an earlier checkpoint, or call "
                         f"reset() instead")


def _as_flag(found_inf: bool | Tensor) -> bool:
    if isinstance(found_inf, Tensor):
        return bool(found_inf.detach().ne(0).any())
    return bool(found_inf)


class LossWeighting(StateModule):
    """Base class of every loss weighting.

    Class attributes a subclass declares:

    * ``name``: registry key (lower case).
    * ``needs_task_gradients``: the call itself computes per-task gradients (GradNorm's norms
      at one layer); all other methods cost no extra backward pass.
    * ``learnable``: :meth:`parameters` yields ``nn.Parameter`` s the *user's* optimizer must
      step (Uncertainty Weighting, IMTL-L).
    * ``_pending_state``: what a step gathers for :meth:`update` besides the losses.

    Tensor state is declared with :meth:`register_state`, which generates :meth:`reset`;
    :meth:`_reset_state` resets the rest (counters, an own optimizer, a generator).

    Args:
        num_tasks: K; every call checks it.
        device: where the state tensors live (default CPU); use the losses' device.
    """

    name: ClassVar[str] = ""
    needs_task_gradients: ClassVar[bool] = False
    learnable: ClassVar[bool] = False
    _kind = "weighting"
    _extra_keys: ClassVar[tuple[str, ...]] = ("num_tasks",)
    #: Buffers stepped by the method's own ``optimizer`` (leaves with ``requires_grad``).
    _self_trained: ClassVar[tuple[str, ...]] = ()
    #: Attributes holding what a step gathers besides the losses for :meth:`update` (None
    #: between steps): :meth:`pending_tensors` returns them, a skipped step drops them.
    _pending_state: ClassVar[tuple[str, ...]] = ()

    def __init__(self, num_tasks: int, *, device: torch.device | str | None = None) -> None:
        super().__init__()
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

    def _reset_state(self) -> None:
        """Back to the state at construction, beyond the declared state (which
        :meth:`reset` restores): counters, an own optimizer, a generator."""

    def _discard_pending(self) -> None:
        """Drop what a step gathered besides the losses (:attr:`_pending_state`)."""
        for name in self._pending_state:
            setattr(self, name, None)

    @property
    def weights(self) -> Tensor:
        """The current task weights ``[K]`` (detached), for logging."""
        raise NotImplementedError

    # -- public -------------------------------------------------------------------------
    def forward(self, losses: Tensor | Sequence[Tensor], *, scaler: Any = None) -> Tensor:
        """Weighted task losses ``[K]`` (same dtype as ``losses``, graph kept).

        Called as ``weighting(losses)``.

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

    def pending_tensors(self) -> list[Tensor]:
        """The pending observation of this step: what :meth:`update` will learn from.

        The summed detached losses ``[K]`` (float64) and whatever a method gathers besides
        (GradNorm: the ``[K, P_layer]`` gradients at its layer); empty before the step's first
        call. The list order is the same on every process. Changing the tensors in place
        changes what :meth:`update` sees: data-parallel training averages them over the ranks
        (:func:`~gradbalance.sync_weighting_`), so that every rank learns from the full batch.
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
        self._pending, self._pending_calls = None, 0
        self._discard_pending()

    def _state_device(self) -> torch.device:
        return self.device

    def _own_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer of the :attr:`_self_trained` buffers, rebuilt by :meth:`_apply`."""
        return None

    def _rebuild_optimizer(self, state: dict[str, Any]) -> None:
        """Build the own optimizer again on the (moved) buffers and load ``state`` into it."""

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        """``.to()``, ``.double()``...: buffers stepped in place by the method's own
        optimizer stay leaves, the optimizer follows them with its state, ``device`` too."""
        own = self._own_optimizer()
        before = {name: self._buffers[name] for name in self._self_trained}
        saved = None if own is None else own.state_dict()
        out = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        moved = False
        for name, tensor in before.items():
            now = self._buffers[name]
            if now is not tensor and now is not None:
                self._buffers[name] = now.detach().requires_grad_(True)
                moved = True
        if moved and saved is not None:
            self._rebuild_optimizer(saved)
        for tensor in [*self._parameters.values(), *self._buffers.values()]:
            if tensor is not None:
                self.device = tensor.device
                break
        return out

    def reset(self) -> None:
        """Forget all state (as freshly built); learnable tensors are reset in place."""
        self._pending, self._pending_calls = None, 0
        self._discard_pending()
        super().reset()
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

