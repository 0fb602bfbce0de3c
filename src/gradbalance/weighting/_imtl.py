"""IMTL-L: the loss-balance half of Impartial Multi-Task Learning (Liu et al., 2021)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._base import LossWeighting

__all__ = ["IMTLL"]


class IMTLL(LossWeighting):
    """Learned loss scales: weighted loss ``e^{sₖ}·Lₖ − sₖ``, ``sₖ`` learnable.

    ``sₖ`` is trained by *your* optimizer, as Uncertainty Weighting's (an ``nn.Parameter``,
    ``log_scales``). Its optimum ``e^{sₖ} = 1/Lₖ`` makes every scaled loss ``1 + log Lₖ``.

    Args:
        dtype: dtype of ``s`` (float32 by default).

    Reference: Liu et al., "Towards Impartial Multi-task Learning", ICLR 2021 (IMTL-L).

    Example:
        >>> import torch
        >>> from gradbalance.weighting import IMTLL
        >>> IMTLL(2)(torch.tensor([1.0, 2.0])).tolist()  # s = 0 at first: eˢL − s = L
        [1.0, 2.0]
    """

    log_scales: nn.Parameter

    name = "imtl_l"
    learnable = True

    def __init__(self, num_tasks: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_tasks, device=device)
        self.register_state("log_scales", nn.Parameter(
            torch.zeros(num_tasks, dtype=dtype, device=self.device)), per_task=True)

    def _weighted(self, losses: Tensor) -> Tensor:
        s = self.log_scales.to(dtype=losses.dtype, device=losses.device)
        return torch.exp(s) * losses - s

    @property
    def weights(self) -> Tensor:
        """``e^{sₖ}`` ``[K]``."""
        return torch.exp(self.log_scales.detach()).clone()

