"""Optimizer-in-backward on the heads (a ``register_post_accumulate_grad_hook`` that steps its
head in place): the balanced step with ``Sum`` matches plain ``sum(losses).backward()``.

The heads' hooks used to run before the task passes, which still read the heads' weights:
torch's in-place error, after every head had moved. Expected values come from the plain loop
on a copy of the same model (the torch tutorial's pattern, one SGD per parameter)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.heads = nn.ModuleList(nn.Linear(8, 1) for _ in range(3))


def _step_heads_in_backward(model: _Model) -> list[int]:
    """Each head parameter steps itself as soon as its gradient is accumulated; the number of
    hook calls per parameter is counted."""
    calls = [0] * len(list(model.heads.parameters()))
    for i, p in enumerate(model.heads.parameters()):
        opt = torch.optim.SGD([p], lr=0.1)

        def hook(param: torch.Tensor, opt: torch.optim.Optimizer = opt, i: int = i) -> None:
            calls[i] += 1
            opt.step()
            opt.zero_grad()
        p.register_post_accumulate_grad_hook(hook)
    return calls


def _losses(model: _Model, x: torch.Tensor,
            y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    f = model.trunk(x)
    return f, torch.stack([((h(f)[:, 0] - y[:, k]) ** 2).mean()
                           for k, h in enumerate(model.heads)])


@pytest.mark.parametrize("mode", ["matrix", "gramian", "auto", "features"])
@pytest.mark.parametrize("micro", [1, 2])
def test_heads_stepped_in_their_hooks_match_plain_pytorch(mode: str, micro: int) -> None:
    if mode == "features" and micro > 1:
        pytest.skip("features mode takes one backward per step")
    torch.manual_seed(0)
    plain = _Model()
    balanced = copy.deepcopy(plain)
    plain_calls = _step_heads_in_backward(plain)
    calls = _step_heads_in_backward(balanced)
    trunk_opt = torch.optim.SGD(plain.trunk.parameters(), lr=0.1)
    opt = torch.optim.SGD(balanced.trunk.parameters(), lr=0.1)
    kwargs = {"modules": balanced.trunk} if mode in ("gramian", "auto") else {}
    buf = TaskGradBuffer(list(balanced.trunk.parameters()), list(balanced.heads.parameters()),
                         mode=mode, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        batches = [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen))
                   for _ in range(micro)]
        for x, y in batches:
            _losses(plain, x, y)[1].sum().backward()
        trunk_opt.step()
        trunk_opt.zero_grad()
        for x, y in batches:
            f, losses = _losses(balanced, x, y)
            buf.backward(losses, features=f if mode == "features" else None)
        buf.apply_(Sum())
        opt.step()
        opt.zero_grad()
    assert calls == plain_calls == [3 * micro] * len(calls)
    for a, b in zip(balanced.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _SparseHead(nn.Module):
    """A linear head plus a per-sample bias read from a sparse embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)
        self.bias = nn.Embedding(10, 1, sparse=True)

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(f.shape[0]) % 10
        return self.linear(f) + self.bias(ids)


@pytest.mark.parametrize("mode", ["matrix", "gramian"])
def test_head_hooks_and_sparse_head_grads_accumulate_as_plain_pytorch(mode: str) -> None:
    # A doubling register_hook on every head parameter runs once per backward, as in plain
    # PyTorch, and a sparse head gradient accumulates over two micro-batches as autograd's.
    torch.manual_seed(0)
    plain = _Model()
    plain.heads = nn.ModuleList(_SparseHead() for _ in range(2))
    balanced = copy.deepcopy(plain)
    counts = {"plain": 0, "balanced": 0}
    for name, model in (("plain", plain), ("balanced", balanced)):
        for p in model.heads.parameters():
            def hook(g: torch.Tensor, name: str = name) -> torch.Tensor:
                counts[name] += 1
                return g * 2
            p.register_hook(hook)
    kwargs = {"modules": balanced.trunk} if mode == "gramian" else {}
    buf = TaskGradBuffer(list(balanced.trunk.parameters()), list(balanced.heads.parameters()),
                         mode=mode, **kwargs)
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen)
        _losses(plain, x, y)[1].sum().backward()
        buf.backward(_losses(balanced, x, y)[1])
    buf.apply_(Sum())
    assert counts["balanced"] == counts["plain"] == 2 * len(list(plain.heads.parameters()))
    for a, b in zip(balanced.parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert a.grad.layout == b.grad.layout
        torch.testing.assert_close(a.grad.to_dense(), b.grad.to_dense(), rtol=1e-5, atol=1e-6)


def test_a_leaf_given_its_plain_gradient_may_step_in_its_hook() -> None:
    # other_params="sum": a learnable scale outside both lists, read by every task, stepped
    # by its own post-accumulate hook, as the heads above.
    torch.manual_seed(0)
    plain = _Model()
    balanced = copy.deepcopy(plain)
    scales = [nn.Parameter(torch.tensor(1.5)) for _ in range(2)]
    for scale in scales:
        opt = torch.optim.SGD([scale], lr=0.05)

        def hook(param: torch.Tensor, opt: torch.optim.Optimizer = opt) -> None:
            opt.step()
            opt.zero_grad()
        scale.register_post_accumulate_grad_hook(hook)
    trunk_opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, balanced)]
    buf = TaskGradBuffer(list(balanced.trunk.parameters()), list(balanced.heads.parameters()),
                         other_params="sum")
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
        (_losses(plain, x, y)[1] * scales[0]).sum().backward()
        trunk_opts[0].step()
        trunk_opts[0].zero_grad()
        buf.backward(_losses(balanced, x, y)[1] * scales[1])
        buf.apply_(Sum())
        trunk_opts[1].step()
        trunk_opts[1].zero_grad()
    torch.testing.assert_close(scales[1], scales[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(balanced.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
