"""DWA: Dynamic Weight Average (Liu, Johns & Davison, 2019)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._checks import (
    check_nonnegative_losses,
    check_optional_int,
    check_positive,
    task_value_vectors,
)
from ._base import LossWeighting, times_weights

__all__ = ["DWA", "dwa_weights"]


def dwa_weights(previous: Tensor, before_previous: Tensor, temperature: float = 2.0) -> Tensor:
    """``wₖ = K·softmax(rₖ/T)ₖ`` with ``rₖ = Lₖ(t−1) / Lₖ(t−2)``, the descent rates.

    Example:
        >>> import torch
        >>> from gradbalance.functional import dwa_weights
        >>> dwa_weights(torch.tensor([0.5, 1.0]), torch.tensor([1.0, 1.0]))  # 2·softmax(r/2)
        tensor([0.8756, 1.1244], dtype=torch.float64)
    """
    previous, before_previous = task_value_vectors(("previous", previous),
                                                   ("before_previous", before_previous))
    check_nonnegative_losses("previous", previous, "dwa_weights")
    check_nonnegative_losses("before_previous", before_previous, "dwa_weights")
    check_positive("temperature", temperature)
    k = previous.shape[0]
    # a loss that fell to 0 and rose again: a rate past float64, kept finite (its task then
    # takes the weight), not an inf whose softmax is NaN
    rate = (previous.double() / before_previous.double().clamp_min(1e-300)).clamp(max=1e300)
    # clamped again after the temperature: rate/T past float64 (T below about 1e-8) made the
    # softmax inf − inf = NaN
    return k * torch.softmax((rate / temperature).clamp(max=1e300), dim=0)


class DWA(LossWeighting):
    """Dynamic Weight Average: weight each task by how slowly its loss has been falling.

    ``wₖ(t) = K·exp(rₖ(t−1)/T) / Σᵢ exp(rᵢ(t−1)/T)``, ``rₖ(t−1) = Lₖ(t−1)/Lₖ(t−2)``, where
    ``Lₖ(t)`` is the mean loss of period ``t``; ``wₖ = 1`` for the first two periods.

    Args:
        temperature: ``T > 0``; the paper uses 2.
        period: optimizer steps (not skipped) per averaging period (the paper's epoch:
            ``steps_per_epoch``), or None to close periods with :meth:`end_period`.

    Reference: Liu, Johns & Davison, "End-to-End Multi-Task Learning with Attention",
    CVPR 2019.

    Example:
        >>> import torch
        >>> from gradbalance.weighting import DWA
        >>> dwa = DWA(2)  # period=1: each step closes a period
        >>> for losses in ([1.0, 1.0], [0.5, 1.0]):
        ...     _ = dwa(torch.tensor(losses)); _ = dwa.update()
        >>> dwa.weights  # 2·softmax((0.5, 1.0) / 2): the slower task weighs more
        tensor([0.8756, 1.1244], dtype=torch.float64)
    """

    name = "dwa"
    _weights_state = "_weights"
    _repr_args = ("num_tasks", "temperature", "period")
    _weights: Tensor
    _history: Tensor
    _window: Tensor
    _periods: Tensor
    _window_steps: Tensor

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
        for name in ("_periods", "_window_steps"):
            self.register_state(name, torch.zeros((), dtype=torch.int64, device=dev))

    def _weighted(self, losses: Tensor) -> Tensor:
        check_nonnegative_losses("losses", losses, type(self).__name__)  # rates of falling
        return times_weights(self._weights, losses)

    def _apply_update(self, losses: Tensor, losses_after: Tensor | None) -> None:
        self._window = self._window + losses
        self._window_steps = self._window_steps + 1
        if self.period is not None and int(self._window_steps) >= self.period:
            self.end_period()

    def end_period(self) -> bool:
        """Close the current period: its mean loss enters the history; new weights.

        Returns False (and changes nothing) when the period holds no step.
        """
        if int(self._window_steps) == 0:
            return False
        mean = self._window / self._window_steps
        self._history = torch.stack([mean, self._history[0]])
        self._periods = self._periods + 1
        self._window = torch.zeros_like(self._window)
        self._window_steps = torch.zeros_like(self._window_steps)
        if int(self._periods) >= 2:
            self._weights = dwa_weights(self._history[0], self._history[1], self.temperature)
        return True
