"""batch_dim=0 takes what the other routes take: a call under torch.no_grad(), and refuses a
complex parameter at construction, naming it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, UPGrad


def _step(seed: int, batch: int, balancer: object, under_no_grad: bool) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    head = nn.Linear(3, 1)
    buf = TaskGradBuffer(list(trunk.parameters()), list(head.parameters()), modules=trunk,
                         batch_dim=0)
    x, y = torch.randn(batch, 4, dtype=torch.float64), torch.randn(batch, dtype=torch.float64)
    trunk.double()
    head.double()
    losses = (head(trunk(x))[:, 0] - y) ** 2  # [B], built with grad enabled
    if under_no_grad:
        with torch.no_grad():
            buf.backward(losses)
            buf.apply_(balancer)  # type: ignore[arg-type]
    else:
        buf.backward(losses)
        buf.apply_(balancer)  # type: ignore[arg-type]
    return [p.grad.clone() for p in [*trunk.parameters(), *head.parameters()]]  # type: ignore[union-attr]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("batch", [3, 7])
@pytest.mark.parametrize("make", [MGDA, UPGrad], ids=["mgda", "upgrad"])
def test_a_call_under_no_grad_gives_the_same_update(seed: int, batch: int, make: type) -> None:
    outside = _step(seed, batch, make(), under_no_grad=False)
    inside = _step(seed, batch, make(), under_no_grad=True)
    for a, b in zip(outside, inside):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Complex modules are a new feature:UserWarning")
@pytest.mark.parametrize("where", ["shared", "head"])
def test_a_complex_parameter_is_refused_at_construction(where: str) -> None:
    trunk = nn.Linear(3, 2)
    head = nn.Linear(2, 1)
    (trunk if where == "shared" else head).to(torch.complex64)
    model = nn.ModuleDict({"trunk": trunk, "head": head})
    with pytest.raises(ValueError, match=r"complex") as error:
        TaskGradBuffer(list(trunk.parameters()), list(head.parameters()), modules=model,
                       batch_dim=0)
    module = "trunk" if where == "shared" else "head"
    assert f"{where}_params[0] ('{module}.weight')" in str(error.value)
