"""IMTL-L: the loss-balance half of Impartial Multi-Task Learning (Liu et al., 2021)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ._base import LossWeighting

__all__ = ["IMTLL"]


class IMTLL(LossWeighting):
    """Learned loss scales: weighted loss ``e^{sₖ}·Lₖ − sₖ``, ``sₖ`` learnable.

    The scale ``sₖ`` is trained by *your* optimizer on the same objective (add
    :meth:`parameters` to it; with a :class:`~gradbalance.TaskGradBuffer` also list them in
    ``head_params``). Its optimum ``e^{sₖ} = 1/Lₖ`` makes every scaled loss
    ``1 + log Lₖ``: all tasks contribute a scaled loss of the same size.

    Args:
        num_tasks: K.
        dtype: dtype of ``s`` (float32 by default).

    Reference: Liu et al., "Towards Impartial Multi-task Learning", ICLR 2021 (IMTL-L).
    """

    name = "imtl_l"
    learnable = True

    def __init__(self, num_tasks: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_tasks, device=device)
        self.log_scales = nn.Parameter(torch.zeros(num_tasks, dtype=dtype, device=self.device))

    def _weighted(self, losses: Tensor) -> Tensor:
        s = self.log_scales.to(dtype=losses.dtype, device=losses.device)
        return torch.exp(s) * losses - s

    def parameters(self) -> list[Tensor]:
        return [self.log_scales]

    @property
    def weights(self) -> Tensor:
        """``e^{sₖ}`` ``[K]``."""
        return torch.exp(self.log_scales.detach()).clone()

    def _state(self) -> dict[str, Any]:
        return {"log_scales": self.log_scales.detach()}

    def _load_state(self, state: dict[str, Any]) -> None:
        value = self._check_state_tensor(state, "log_scales", (self.num_tasks,))
        with torch.no_grad():
            self.log_scales.copy_(value)

    def _reset_state(self) -> None:
        with torch.no_grad():
            self.log_scales.zero_()
