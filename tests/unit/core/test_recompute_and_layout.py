"""Module state and gradient layouts as plain PyTorch leaves them.

A ``BatchNorm`` inside ``torch.utils.checkpoint(..., use_reentrant=False)`` is recomputed in
every backward through it: plain ``sum(losses).backward()`` counts one recomputation, the
loop's K passes counted K (its running mean 0.8 of its size off at K = 3), and a refused
``passes="batched"`` try moved it before raising. A new ``.grad`` takes the parameter's
strides in plain PyTorch (channels-last, transposed leaves): the step wrote them row-major.
The reference is plain ``backward`` on an identical model (docs/loop.md, "Inputs plain
PyTorch takes").
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gradbalance import TaskGradBuffer, balanced_backward
from gradbalance.balancers import Sum, UPGrad

K = 3
ROUTES = [("matrix", "loop"), ("matrix", "batched"), ("matrix", "measure"),
          ("gramian", "loop"), ("gramian", "batched"), ("auto", "auto")]


class Net(nn.Module):
    """A trunk whose first block, a linear layer, a BatchNorm and ``extra``, runs under a
    non-reentrant checkpoint; K linear heads; float64."""

    def __init__(self, extra: nn.Module | None = None, twice: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8),
                                   extra or nn.Identity(), nn.Tanh())
        self.out = nn.Linear(8, 5)
        self.heads = nn.ModuleList(nn.Linear(5, 1) for _ in range(K))
        self.twice = twice  # the block run twice inside the segment
        self.double()

    def segment(self, x: Tensor) -> Tensor:
        y = self.block(x)
        return self.block(y[:, :6]) if self.twice else y

    def losses(self, seed: int) -> list[Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(6, 6, generator=g, dtype=torch.float64)
        y = torch.randn(6, K, generator=g, dtype=torch.float64)
        f = self.out(checkpoint(self.segment, x, use_reentrant=False))
        return [((h(f)[:, 0] - y[:, k]) ** 2).mean() for k, h in enumerate(self.heads)]

    def trunk(self) -> list[nn.Parameter]:
        return [*self.block.parameters(), *self.out.parameters()]


def _buffers(net: Net) -> dict[str, Tensor]:
    return {n: b.clone() for n, b in net.named_buffers()}


def _assert_same(got: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), (name, got[name], value)


def _plain(steps: int, micro: int, **net: object) -> tuple[dict[str, Tensor], list[Tensor]]:
    model = Net(**net)  # type: ignore[arg-type]
    for step in range(steps):
        for m in range(micro):
            sum(model.losses(10 * step + m)).backward()
    return _buffers(model), [p.grad.clone() for p in model.trunk()]


@pytest.mark.parametrize(("mode", "passes"), ROUTES)
@pytest.mark.parametrize(("steps", "micro", "every"), [(1, 1, 1), (1, 2, 1), (3, 1, 2)])
def test_a_checkpointed_batchnorm_counts_one_recomputation(mode: str, passes: str,
                                                           steps: int, micro: int,
                                                           every: int) -> None:
    expected, grads = _plain(steps, micro)
    model = Net()
    buf = TaskGradBuffer(model.trunk(), model.heads.parameters(), mode=mode, passes=passes,
                         modules=model, update_every=every)
    for step in range(steps):
        for m in range(micro):
            buf.backward(model.losses(10 * step + m))
        buf.apply_(Sum())
    _assert_same(_buffers(model), expected)  # the running statistics, the count
    for got, want in zip([p.grad for p in model.trunk()], grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("twice", [False, True])
def test_the_one_shot_call_and_a_block_run_twice_count_as_plain(twice: bool) -> None:
    expected, _ = _plain(1, 1, twice=twice)
    model = Net(twice=twice)
    balanced_backward(model.losses(0), UPGrad(), shared_params=model.trunk(),
                      head_params=model.heads.parameters(), passes="loop")
    _assert_same(_buffers(model), expected)


def test_a_refused_batched_pass_leaves_the_running_statistics() -> None:
    # vmap refuses the dropout inside the segment after the BatchNorm was recomputed
    model = Net(extra=nn.Dropout(0.1))
    losses = model.losses(0)
    before = _buffers(model)
    buf = TaskGradBuffer(model.trunk(), model.heads.parameters(), passes="batched")
    with pytest.raises(RuntimeError, match="passes='batched' failed"):
        buf.backward(losses)
    _assert_same(_buffers(model), before)
    assert all(p.grad is None for p in model.parameters())


def test_a_failed_step_puts_the_recomputed_state_back() -> None:
    model = Net()
    losses = model.losses(0)
    before = _buffers(model)
    buf = TaskGradBuffer(model.trunk(), model.heads.parameters(), passes="loop")

    calls = []

    def fail_on_second(grad: Tensor) -> Tensor:
        calls.append(1)
        if len(calls) == 2:  # the second task's pass, after the first recomputed the block
            raise RuntimeError("injected")
        return grad

    handle = model.out.weight.register_hook(fail_on_second)
    with pytest.raises(RuntimeError, match="injected"):
        buf.backward(losses)
    handle.remove()
    _assert_same(_buffers(model), before)


LayoutCase = Callable[[], tuple[nn.Module, list[nn.Parameter], Callable[[], list[Tensor]]]]


def _channels_last() -> tuple[nn.Module, list[nn.Parameter], Callable[[], list[Tensor]]]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 2, 3),
                          nn.Flatten()).to(memory_format=torch.channels_last)
    heads = nn.ModuleList(nn.Linear(32, 1) for _ in range(K))
    x = torch.randn(5, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    model = nn.ModuleDict({"trunk": trunk, "heads": heads})

    def losses() -> list[Tensor]:
        f = trunk(x)
        return [h(f).pow(2).mean() for h in heads]
    return model, list(trunk.parameters()), losses


def _transposed() -> tuple[nn.Module, list[nn.Parameter], Callable[[], list[Tensor]]]:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(6, 8).T)  # [8, 6], strides (1, 8)
    heads = nn.ModuleList(nn.Linear(6, 1) for _ in range(K))
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    model = nn.ModuleDict({"heads": heads})

    def losses() -> list[Tensor]:
        f = torch.tanh(x @ weight)
        return [h(f).pow(2).mean() for h in heads]
    return model, [weight], losses


@pytest.mark.parametrize("case", [_channels_last, _transposed])
@pytest.mark.parametrize(("mode", "passes"), [("matrix", "loop"), ("matrix", "batched"),
                                              ("auto", "auto")])
def test_a_new_grad_takes_the_parameters_strides(case: LayoutCase, mode: str,
                                                 passes: str) -> None:
    model, trunk, losses = case()
    sum(losses()).backward()
    plain = [p.grad for p in trunk]
    assert any(not p.is_contiguous() for p in trunk)  # the case is what it claims
    model, trunk, losses = case()
    heads = [p for p in model.parameters() if all(p is not q for q in trunk)]
    buf = TaskGradBuffer(trunk, heads, mode=mode, passes=passes, modules=model)
    buf.backward(losses())
    buf.apply_(Sum())
    for p, want in zip(trunk, plain):
        assert p.grad.stride() == want.stride() == p.stride()
        torch.testing.assert_close(p.grad, want)
