"""``update_every=T``: the balancer's weights every T steps, one backward of ``Σₖ wₖ Lₖ`` in
between (docs/performance.md, "Modes").

Reference: Navon et al., "Multi-Task Learning as a Bargaining Game", ICML 2022, §5.4.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._amp import finite_update, nonfinite_error
from .._checks import check_int
from ..balancers._base import Balancer
from ..stats import StepStats
from ..taskgrads import TaskRoots
from ._engine import StepInput, WriteBack, commit
from ._layout import Columns, Held

__all__ = ["ReusedStep", "WeightCache"]


class WeightCache:
    """The cached weights, their balancer and the step counter (refresh: ``t % T == 0``)."""

    def __init__(self, update_every: int = 1) -> None:
        self.update_every = check_int("update_every", update_every, 1,
                                      "; 1 recomputes the weights every step")
        self.step = 0
        self.weights: Tensor | None = None
        self._owner: weakref.ref[Balancer] | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> WeightCache:
        """A copy whose weights belong to the copy of their balancer where that is copied in
        the same ``deepcopy`` call (a copied buffer then takes the copied balancer), else to
        no balancer yet: the weak reference to the original is not carried over."""
        out = WeightCache(self.update_every)
        out.step = self.step
        out.weights = None if self.weights is None else self.weights.clone()
        owner = None if self._owner is None else self._owner()
        copied = None if owner is None else memo.get(id(owner))
        out._owner = None if copied is None else weakref.ref(copied)
        return out

    @property
    def active(self) -> bool:
        return self.update_every > 1

    def reuse_now(self) -> bool:
        """True when this step reuses the cached weights."""
        return self.active and self.weights is not None and self.step % self.update_every != 0

    def check_balancer(self, balancer: Balancer) -> None:
        """Raise ``ValueError`` when a reuse step gets another balancer than the weights'."""
        owner = None if self._owner is None else self._owner()
        if owner is not None and owner is not balancer:
            raise ValueError(
                f"balancer is another object than the {type(owner).__name__} "
                f"whose weights update_every={self.update_every} reuses until step "
                f"{self.step + self.update_every - self.step % self.update_every}; pass the "
                f"same balancer object every step (or call reset() to start a new window)"
            )

    def refreshed(self, weights: Tensor | None, balancer: Balancer) -> None:
        """A refresh step of ``balancer`` finished with finite gradients and these weights."""
        if self.active:
            self.weights = None if weights is None else weights.detach().clone()
            self._owner = weakref.ref(balancer)
        self.step += 1

    def reused(self, balancer: Balancer) -> None:
        self._owner = weakref.ref(balancer)
        self.step += 1

    def mark(self) -> tuple[int, Tensor | None, weakref.ref[Balancer] | None]:
        """The counter, the weights and their balancer as they are (:meth:`rewind`)."""
        return self.step, self.weights, self._owner

    def rewind(self, mark: tuple[int, Tensor | None, weakref.ref[Balancer] | None]) -> None:
        """Back to :meth:`mark`'s state (a step dropped after it counted)."""
        self.step, self.weights, self._owner = mark

    def state_dict(self) -> dict[str, Any]:
        return {
            "update_every": self.update_every,
            "step": self.step,
            "weights": None if self.weights is None else self.weights.clone(),
        }

    def load_state_dict(self, state_dict: dict[str, Any], num_tasks: int | None) -> None:
        """Restore :meth:`state_dict`, checked first (``num_tasks``: K, or None if unknown)."""
        self.put(*self.checked(state_dict, num_tasks))

    def checked(self, state_dict: dict[str, Any],
                num_tasks: int | None) -> tuple[int, Tensor | None]:
        """The counter and weights :meth:`load_state_dict` would restore (float64), checked;
        nothing changes."""
        missing = {"update_every", "step", "weights"} - set(state_dict)
        if missing:
            raise ValueError(
                f"state_dict misses {sorted(missing)}; pass the output of "
                f"TaskGradBuffer.state_dict()"
            )
        check_int("state_dict['update_every']", state_dict["update_every"], 1)
        if state_dict["update_every"] != self.update_every:
            raise ValueError(
                f"Invalid state_dict: update_every={state_dict['update_every']} but this buffer "
                f"has update_every={self.update_every}; build it with the saved value"
            )
        step = check_int("state_dict['step']", state_dict["step"], 0)
        weights = state_dict["weights"]
        if weights is not None:
            check_cached_weights(weights, num_tasks)
            weights = weights.detach().to(torch.float64, copy=True)  # as a balancer gives them
        return step, weights

    def put(self, step: int, weights: Tensor | None) -> None:
        """Restore :meth:`checked`'s counter and weights; the balancer they came from is
        forgotten unless they are the cached weights themselves (a load of this cache's own
        state, a checkpoint's roll-back, changes nothing)."""
        same = (weights is None and self.weights is None) or (
            weights is not None and self.weights is not None
            and weights.shape == self.weights.shape and bool(torch.equal(
                weights, self.weights.to(device=weights.device, dtype=weights.dtype))))
        self.step, self.weights = step, weights
        if not same:
            self._owner = None

    def reset(self) -> None:
        self.step = 0
        self.weights = None
        self._owner = None


def check_cached_weights(weights: Any, num_tasks: int | None) -> None:
    """Raise ``ValueError`` unless ``weights`` are K finite floating numbers ``[K]``."""
    if not isinstance(weights, Tensor) or not weights.is_floating_point() \
            or weights.dim() != 1 or weights.numel() == 0:
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(
            f"Invalid state_dict['weights']: {shape} (expected a floating tensor [K] of the "
            f"task weights); pass the output of TaskGradBuffer.state_dict()"
        )
    if num_tasks is not None and weights.shape[0] != num_tasks:
        raise ValueError(
            f"Invalid state_dict['weights']: {weights.shape[0]} task weights but this buffer "
            f"has num_tasks={num_tasks}; load a state saved with the same tasks"
        )
    if not bool(torch.isfinite(weights).all()):
        raise ValueError(
            f"Invalid state_dict['weights']: {weights.tolist()} holds inf/NaN; load an earlier "
            f"checkpoint, or drop 'weights' (None) so that the next step recomputes them"
        )


class ReusedStep:
    """A reuse step: the trunk's ``Σₖ wₖ ∂Lₖ/∂θ`` over the micro-batches, until :meth:`finish`."""

    def __init__(self, columns: Columns) -> None:
        self.columns = columns
        self.held: Held | None = None

    def backward(self, weights: Tensor, roots: TaskRoots, shared: Sequence[Tensor],
                 head_params: Sequence[Tensor]) -> None:
        """Heads ``.grad += ∂(Σₖ Lₖ)``; the trunk's ``∂(Σₖ wₖ Lₖ)`` held."""
        self.held = self.columns.reused_backward(weights, roots, head_params, self.held)

    def finish(self, cache: WeightCache, step: StepInput, shared: Sequence[Tensor],
               head_params: Sequence[Tensor], mode: str, balancer: Balancer) -> StepStats:
        """Average over the ranks, check, write (:func:`commit_reused`)."""
        held, self.held = self.held, None
        update, losses = self.columns.reused_update(held, step.losses, head_params,
                                                    step.group)
        return commit_reused(update, cache, step, losses, head_params, mode, balancer)

    def clear(self) -> None:
        self.held = None


def commit_reused(update: WriteBack, cache: WeightCache, step: StepInput, losses: Tensor,
                  head_params: Sequence[Tensor], mode: str, balancer: Balancer) -> StepStats:
    """A reuse step's end: check the update (one host sync), write it, count it if finite."""
    heads = head_params if step.scale is not None else ()
    finite = finite_update(update.bound(), None, update.dtype, step.group, heads, losses)
    if not finite and step.scale is None:
        raise nonfinite_error()
    stats = StepStats(losses=losses, task_norms=None, cosine=None, cosine_to_update=None,
                      update_norm=None, weights=cache.weights, found_inf=not finite,
                      loss_scale_tensor=step.scale, num_backward=step.count, mode=mode,
                      weights_reused=True)
    commit(update, head_params, finite)
    if finite:
        cache.reused(balancer)
    return stats
