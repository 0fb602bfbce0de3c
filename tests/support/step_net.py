"""A small float64 model for step tests: a two-layer trunk and K linear heads, with an
injectable out-of-memory error in the trunk's forward."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class StepNet(nn.Module):
    """``trunk``: Linear, Tanh, Linear; ``heads``: K ``Linear(width, 1)``. ``fail_at``: the
    trunk's second layer raises ``torch.OutOfMemoryError`` on that forward call (counted in
    ``calls``), after the first layer has run."""

    def __init__(self, d_in: int, width: int, num_tasks: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(d_in, width), nn.Tanh(), nn.Linear(width, width))
        self.heads = nn.ModuleList([nn.Linear(width, 1) for _ in range(num_tasks)])
        self.double()
        self.calls = 0
        self.fail_at: int | None = None
        self.trunk[2].register_forward_pre_hook(self._maybe_fail)

    def _maybe_fail(self, module: nn.Module, args: object) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError("injected: out of memory")

    def features(self, x: Tensor) -> Tensor:
        return torch.tanh(self.trunk(x))

    def task_losses(self, feats: Tensor, y: Tensor, divisor: int = 1) -> Tensor:
        """The K squared errors (batch means) over ``divisor``, stacked."""
        return torch.stack([((h(feats)[:, 0] - y[:, k]) ** 2).mean() / divisor
                            for k, h in enumerate(self.heads)])
