"""Per-sample losses ``[B, K]`` stacked along the tasks with ``B = K`` and an operation after
the stack (``/ M``, the micro-batch recipe): the stack has K inputs, which the task route's
search for a ``[K]`` loss vector's stack took for tasks, and the backward raised a shape
mismatch. The reference is the same losses without the division: UPGrad is homogeneous, so
the update is half of theirs."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import UPGrad


def _update(b: int, k: int, divide: bool) -> list[Tensor]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    heads = nn.ModuleList([nn.Linear(5, 1) for _ in range(k)]).double()
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(b, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(b, k, generator=gen, dtype=torch.float64)
    f = trunk(x)
    losses = torch.stack([(h(f)[:, 0] - y[:, j]) ** 2 for j, h in enumerate(heads)], dim=1)
    buf.backward(losses / 2 if divide else losses)
    buf.apply_(UPGrad())
    return [p.grad.clone() for p in trunk.parameters() if p.grad is not None]


@pytest.mark.parametrize(("b", "k"), [(2, 2), (3, 3), (4, 2)])
def test_square_per_sample_losses_after_an_operation(b: int, k: int) -> None:
    half, whole = _update(b, k, True), _update(b, k, False)
    assert len(half) == len(whole) == 4
    for h, w in zip(half, whole, strict=True):
        torch.testing.assert_close(h, w / 2, rtol=1e-10, atol=1e-14)
