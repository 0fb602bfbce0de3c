"""``mode="features"`` refuses losses that reach a trunk parameter around ``features=``.

The mode backpropagates the balanced feature gradient through the trunk once, from
``features``; a loss that also reaches a shared parameter another way (a skip connection
around ``features``, a trunk weight read by a head, a penalty on a trunk weight, or
``features`` taken before the trunk's last layers) would lose that part of the gradient,
where ``sum(losses).backward()`` keeps it. The step refuses before anything moves, and the
same buffer then takes a correct step: the trunk's ``.grad`` of the Sum balancer equals
plain autograd's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum

F64 = torch.float64


def _net() -> tuple[nn.ModuleList, nn.ModuleList]:
    torch.manual_seed(0)
    trunk = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]).double()
    heads = nn.ModuleList([nn.Linear(4, 1) for _ in range(2)]).double()
    return trunk, heads


def _losses(trunk: nn.ModuleList, heads: nn.ModuleList, x: torch.Tensor,
            kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(losses, features)`` for one way of reaching the trunk (``plain``: through the
    features only)."""
    a = torch.tanh(trunk[0](x))
    f = torch.tanh(trunk[1](a))
    first = heads[0](f + a if kind == "skip" else f).pow(2).mean()
    second = heads[1](f).pow(2).mean()
    if kind == "tied":  # a head reads a trunk weight
        second = second + nn.functional.linear(f, trunk[1].weight).pow(2).mean()
    if kind == "penalty":
        first = first + 0.1 * trunk[0].weight.pow(2).sum()
    return torch.stack([first, second]), (a if kind == "intermediate" else f)


@pytest.mark.parametrize("kind", ["skip", "tied", "penalty", "intermediate"])
def test_a_path_around_the_features_is_refused_and_nothing_moves(kind: str) -> None:
    trunk, heads = _net()
    buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()), mode="features")
    x = torch.randn(5, 4, dtype=F64)
    losses, feats = _losses(trunk, heads, x, kind)
    with pytest.raises(ValueError, match="on a path that does not pass through it"):
        buf.backward(losses, features=feats)
    assert all(p.grad is None for p in [*trunk.parameters(), *heads.parameters()])
    losses, feats = _losses(trunk, heads, x, "plain")  # the same buffer, a correct step
    buf.backward(losses, features=feats)
    buf.apply_(Sum())
    got = [p.grad.clone() for p in [*trunk.parameters(), *heads.parameters()]]
    for p in [*trunk.parameters(), *heads.parameters()]:
        p.grad = None
    losses, _ = _losses(trunk, heads, x, "plain")
    losses.sum().backward()
    for g, p in zip(got, [*trunk.parameters(), *heads.parameters()], strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-12, atol=1e-15)
