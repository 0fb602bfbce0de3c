"""Hooks on the loss vector run as under ``sum(losses).backward()``.

A tensor hook on the ``[K]`` losses (the user's, or the one FSDP2 puts on the root module's
output to gather its parameters before backward) must run in every task's pass: each pass
starts at the losses, never past them at the ``torch.stack`` inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum

K = 3


class StackedLosses(nn.Module):
    """A trunk and K heads whose forward returns the K losses stacked into one ``[K]``."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6))
        self.heads = nn.ModuleList(nn.Linear(6, 1) for _ in range(K))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.trunk(x)
        return torch.stack([((head(h).squeeze(-1) - y[:, k]) ** 2).mean()
                            for k, head in enumerate(self.heads)])


def _data() -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 4, generator=gen), torch.randn(8, K, generator=gen)


def _plain_grads(model: StackedLosses, hook: object, through: str) -> list[Tensor]:
    x, y = _data()
    losses = model(x, y)
    root = losses / 2 if through == "div" else losses
    losses.register_hook(hook)  # type: ignore[arg-type]
    root.sum().backward()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["matrix", "gramian", "auto"])
@pytest.mark.parametrize("through", ["none", "div"])
def test_a_hook_on_the_losses_changes_the_update_as_in_plain_backward(mode: str,
                                                                      through: str) -> None:
    torch.manual_seed(0)
    model = StackedLosses()
    weights = torch.tensor([2.0, -1.0, 0.5])
    calls: list[int] = []

    def hook(grad: Tensor) -> Tensor:
        calls.append(1)
        return grad * weights

    expected = _plain_grads(model, hook, through)
    model.zero_grad()
    calls.clear()
    x, y = _data()
    losses = model(x, y)
    losses.register_hook(hook)
    buf = TaskGradBuffer(list(model.trunk.parameters()), list(model.heads.parameters()),
                         mode=mode, modules=model.trunk)
    buf.backward(losses / 2 if through == "div" else losses)
    buf.apply_(Sum())
    assert calls, "the hook on the losses never ran"
    for got, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])


@pytest.mark.skipif(_TORCH <= (2, 6), reason="FSDP2 on CPU processes needs torch newer than "
                    "2.6 (its fully_shard calls Stream.record_event, which the CPU stream "
                    "lacks there)")
@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("wrap", ["root", "layers"])
def test_a_fully_sharded_root_returning_stacked_losses_gathers_its_parameters(
        wrap: str) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    reference = StackedLosses()
    model = StackedLosses()
    model.load_state_dict(reference.state_dict())
    if wrap == "layers":
        for layer in model.trunk:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
    fully_shard(model)
    x, y = _data()
    reference(x, y).sum().backward()
    for _ in range(2):  # the second step runs on parameters resharded after the first
        model.zero_grad()
        buf = TaskGradBuffer(list(model.trunk.parameters()), list(model.heads.parameters()))
        buf.backward(model(x, y))
        buf.apply_(Sum())
        for got, want in zip(model.parameters(), reference.parameters(), strict=True):
            assert got.grad is not None
            full = got.grad.full_tensor() if hasattr(got.grad, "full_tensor") else got.grad
            torch.testing.assert_close(full, want.grad, rtol=1e-6, atol=1e-7)
