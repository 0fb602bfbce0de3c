"""DWA: Dynamic Weight Average (Liu, Johns & Davison, 2019)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._checks import check_optional_int, check_positive
from ._base import LossWeighting

__all__ = ["DWA", "dwa_weights"]


def dwa_weights(previous: Tensor, before_previous: Tensor, temperature: float = 2.0) -> Tensor:
    """``wₖ = K·softmax(rₖ/T)ₖ`` with ``rₖ = Lₖ(t−1) / Lₖ(t−2)``, the descent rates."""
    k = previous.shape[0]
    rate = previous.double() / before_previous.double().clamp_min(1e-300)
    return k * torch.softmax(rate / temperature, dim=0)


class DWA(LossWeighting):
    """Dynamic Weight Average: weight each task by how slowly its loss has been falling.

    ``wₖ(t) = K·exp(rₖ(t−1)/T) / Σᵢ exp(rᵢ(t−1)/T)``, ``rₖ(t−1) = Lₖ(t−1)/Lₖ(t−2)``, where
    ``Lₖ(t)`` is the mean loss of period ``t``; ``wₖ = 1`` for the first two periods.

    A period is ``period`` calls of :meth:`update` (the paper averages over an epoch:
    pass ``period=steps_per_epoch``), or ``period=None`` and close it yourself with
    :meth:`end_period`. Skipped steps do not count.

    Args:
        num_tasks: K.
        temperature: ``T > 0``; the paper uses 2.
        period: optimizer steps per averaging period, or None for :meth:`end_period`.

    State: the buffers ``_weights`` ``[K]``, ``_history`` ``[2, K]`` and ``_window`` ``[K]``;
    the period and window counts in the extra state.

    Reference: Liu, Johns & Davison, "End-to-End Multi-Task Learning with Attention",
    CVPR 2019.
    """

    name = "dwa"
    _extra_keys = ("num_tasks", "periods", "window_steps")
    _weights: Tensor
    _history: Tensor
    _window: Tensor

    def __init__(self, num_tasks: int, *, temperature: float = 2.0, period: int | None = 1,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_tasks, device=device)
        self.temperature = check_positive("temperature", temperature)
        self.period = check_optional_int("period", period, 1,
                                         ", or None to close periods with end_period()")
        k, dev = self.num_tasks, self.device
        self.register_state("_weights", torch.ones(k, dtype=torch.float64, device=dev),
                            per_task=True)
        self.register_state("_history", torch.zeros(2, k, dtype=torch.float64, device=dev),
                            per_task=True, task_dim=1)  # L(t-1), L(t-2)
        self.register_state("_window", torch.zeros(k, dtype=torch.float64, device=dev),
                            per_task=True)
        self._reset_state()

    def _reset_state(self) -> None:
        self._periods = 0
        self._window_steps = 0

    def _weighted(self, losses: Tensor) -> Tensor:
        return self._weights.to(dtype=losses.dtype, device=losses.device) * losses

    def _apply_update(self, losses: Tensor, losses_after: Tensor | None) -> None:
        self._window = self._window + losses
        self._window_steps += 1
        if self.period is not None and self._window_steps >= self.period:
            self.end_period()

    def end_period(self) -> bool:
        """Close the current period: its mean loss enters the history; new weights.

        Returns False (and changes nothing) when the period holds no step.
        """
        if self._window_steps == 0:
            return False
        mean = self._window / self._window_steps
        self._history = torch.stack([mean, self._history[0]])
        self._periods += 1
        self._window = torch.zeros_like(self._window)
        self._window_steps = 0
        if self._periods >= 2:
            self._weights = dwa_weights(self._history[0], self._history[1], self.temperature)
        return True

    @property
    def weights(self) -> Tensor:
        return self._weights.clone()

    def _extra_state(self) -> dict[str, Any]:
        return {**super()._extra_state(), "periods": self._periods,
                "window_steps": self._window_steps}

    def _load_extra(self, extra: dict[str, Any]) -> None:
        super()._load_extra(extra)
        self._periods = int(extra.get("periods", 0))
        self._window_steps = int(extra.get("window_steps", 0))

    def __repr__(self) -> str:
        return f"DWA(num_tasks={self.num_tasks}, temperature={self.temperature}, " \
               f"period={self.period})"
