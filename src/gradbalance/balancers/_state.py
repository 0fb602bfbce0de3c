"""State plumbing of the stateful balancers: copies, step counters, shape checks.

Not a balancer module (no ``__all__``). A stateful balancer keeps tensors (None before its
first call), saves copies and, before any update, checks that the input still matches the
state (same tasks, same parameters), so a mismatch raises instead of broadcasting silently.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._statedict import check_keys, tag_state, untag_state


def clone_or_none(t: Tensor | None) -> Tensor | None:
    """A detached copy, or None."""
    return None if t is None else t.detach().clone()


def as_step(value: Any) -> Tensor:
    """A step counter as a 0-d int64 tensor (a copy)."""
    return torch.as_tensor(value, dtype=torch.int64).clone()


def check_state_rows(owner: str, state: Tensor | None, matrix: Tensor) -> None:
    """Stateful matrix balancers: the input must match the shape of the tracked state."""
    if state is None:
        return
    if state.shape != matrix.shape:
        raise ValueError(
            f"matrix has shape {tuple(matrix.shape)} but {owner} tracks state of shape "
            f"{tuple(state.shape)} from earlier calls; pass the same tasks and parameters every "
            f"step, or call reset() first"
        )


def check_state_tasks(owner: str, state: Tensor | None, k: int) -> None:
    """Stateful weighted balancers: the number of tasks must match the tracked weights."""
    if state is not None and state.shape[0] != k:
        raise ValueError(
            f"got {k} tasks but {owner} tracks weights for {state.shape[0]} tasks from earlier "
            f"calls; pass the same tasks every step, or call reset() first"
        )


class EmaStepState:
    """Reset, save and load a balancer whose state is one EMA tensor ``_ema`` and ``_step``.

    ``_ema`` is None before the first call; ``_step`` counts the calls (0-d int64).
    """

    _ema: Tensor | None
    _step: Tensor

    def reset(self) -> None:
        self._ema = None
        self._step = torch.zeros((), dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return tag_state(self, {"ema": clone_or_none(self._ema), "step": self._step.clone()})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = untag_state(self, state_dict, "balancer")
        check_keys(type(self).__name__, state, ["ema", "step"])
        ema, step = clone_or_none(state.get("ema")), as_step(state.get("step", 0))
        self._ema, self._step = ema, step
