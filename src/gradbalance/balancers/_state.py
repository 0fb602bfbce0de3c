"""State plumbing of the stateful balancers: the EMA-and-step base, shape checks.

Not a balancer module (no ``__all__``). A stateful balancer keeps tensors in buffers (None
before its first call) and, before any update, checks that the input still matches the
state (same tasks, same parameters), so a mismatch raises instead of broadcasting silently.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._base import Balancer


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


class EmaStepState(Balancer):
    """A balancer whose state is one EMA tensor ``_ema`` and a step count ``_step`` (buffers).

    ``_ema`` is None before the first call; ``_step`` counts the calls (0-d int64). Saved by
    0.1/0.2 as ``"ema"`` and ``"step"``.
    """

    _ema: Tensor | None
    _step: Tensor

    def __init__(self, num_tasks: int | None = None) -> None:
        super().__init__(num_tasks)
        self.register_state("_ema", None, optional=True)
        self.register_state("_step", torch.zeros((), dtype=torch.int64))

    def reset(self) -> None:
        self._ema = None
        self._step = torch.zeros((), dtype=torch.int64)
