"""batch_dim=0: the heads' ``.grad`` are written by each ``backward`` (as a plain backward
writes them), watched until the step's next call, and put back when the step is dropped.

Expected values come from plain ``loss.sum().backward()`` on a copy of the same model. Before,
the heads' gradients waited in the buffer until ``apply_``: a ``zero_grad()`` after a failed
micro-batch (the plain recovery) went unseen and the abandoned micro-batch was trained on; a
trunk layer frozen between two micro-batches, or a head frozen after the buffer was built,
gave torch's error (the first one dropping the step)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum


def _model() -> tuple[nn.Module, nn.ModuleList]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
    heads = nn.ModuleList(nn.Linear(8, 1) for _ in range(2))
    return trunk, heads


def _losses(trunk: nn.Module, heads: nn.ModuleList, x: torch.Tensor,
            y: torch.Tensor) -> torch.Tensor:
    f = trunk(x)
    return torch.stack([(h(f)[:, 0] - y[:, k]) ** 2 for k, h in enumerate(heads)], 1)


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 2, generator=gen))
            for _ in range(n)]


def _buffer(trunk: nn.Module, heads: nn.ModuleList) -> TaskGradBuffer:
    return TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()), modules=trunk,
                          batch_dim=0)


def test_each_backward_writes_the_heads_grad_as_plain_pytorch() -> None:
    trunk, heads = _model()
    plain_trunk, plain_heads = copy.deepcopy(trunk), copy.deepcopy(heads)
    buf = _buffer(trunk, heads)
    for x, y in _batches(2):
        buf.backward(_losses(trunk, heads, x, y))
        _losses(plain_trunk, plain_heads, x, y).sum().backward()
        for a, b in zip(heads.parameters(), plain_heads.parameters(), strict=True):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)
        assert all(p.grad is None for p in trunk.parameters())  # the trunk's at apply_
    buf.apply_(Sum())
    for a, b in zip([*trunk.parameters(), *heads.parameters()],
                    [*plain_trunk.parameters(), *plain_heads.parameters()], strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_after_a_failed_micro_batch_is_refused_then_reset_drops_it(
        set_to_none: bool) -> None:
    trunk, heads = _model()
    plain_trunk, plain_heads = copy.deepcopy(trunk), copy.deepcopy(heads)
    optimizer = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1)
    buf = _buffer(trunk, heads)
    first, failed, nxt = _batches(3)
    buf.backward(_losses(trunk, heads, *first))
    _losses(trunk, heads, *failed)  # its forward "fails": the loop drops the batch
    optimizer.zero_grad(set_to_none=set_to_none)
    with pytest.raises(RuntimeError, match=r"head_params\[0\].*buf\.reset\(\)"):
        buf.backward(_losses(trunk, heads, *nxt))
    buf.reset()
    optimizer.zero_grad(set_to_none=set_to_none)
    buf.backward(_losses(trunk, heads, *nxt))
    buf.apply_(Sum())
    _losses(plain_trunk, plain_heads, *nxt).sum().backward()  # plain: the next batch only
    for a, b in zip([*trunk.parameters(), *heads.parameters()],
                    [*plain_trunk.parameters(), *plain_heads.parameters()], strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_a_head_frozen_after_the_buffer_is_refused_by_name() -> None:
    trunk, heads = _model()
    buf = _buffer(trunk, heads)
    heads[1].requires_grad_(False)
    x, y = _batches(1)[0]
    with pytest.raises(ValueError, match=r"head_params\[2\] \(shape \(1, 8\)\) no longer "
                                         r"requires grad"):
        buf.backward(_losses(trunk, heads, x, y))
    assert all(p.grad is None for p in [*trunk.parameters(), *heads.parameters()])
    assert not buf.in_step


def test_a_trunk_layer_frozen_between_micro_batches_is_refused_and_the_step_kept() -> None:
    trunk, heads = _model()
    plain_trunk, plain_heads = copy.deepcopy(trunk), copy.deepcopy(heads)
    buf = _buffer(trunk, heads)
    first, second = _batches(2)
    buf.backward(_losses(trunk, heads, *first))
    after_first = [p.grad.clone() for p in heads.parameters()]
    trunk[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"shared_params\[0\] \(shape \(8, 6\)\) stopped "
                                         r"requiring grad"):
        buf.backward(_losses(trunk, heads, *second))
    assert buf.in_step  # the step kept, nothing moved
    assert all(torch.equal(p.grad, g) for p, g in zip(heads.parameters(), after_first))
    trunk[0].requires_grad_(True)  # unfrozen, the forward run again: the step goes on
    buf.backward(_losses(trunk, heads, *second))
    buf.apply_(Sum())
    for x, y in (first, second):
        _losses(plain_trunk, plain_heads, x, y).sum().backward()
    for a, b in zip([*trunk.parameters(), *heads.parameters()],
                    [*plain_trunk.parameters(), *plain_heads.parameters()], strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_a_dropped_step_puts_the_heads_grad_back() -> None:
    trunk, heads = _model()
    for p in heads.parameters():
        p.grad = torch.full_like(p, 0.25)
    buf = _buffer(trunk, heads)
    first, second = _batches(2)
    buf.backward(_losses(trunk, heads, *first))
    losses = _losses(trunk, heads, *second)

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("hook failed")
    losses.register_hook(fail)
    with pytest.raises(RuntimeError, match="hook failed"):
        buf.backward(losses)
    assert not buf.in_step
    assert all(bool((p.grad == 0.25).all()) for p in heads.parameters())


def test_heads_stepped_in_their_hooks_match_plain_pytorch() -> None:
    # One micro-batch per step: the heads' post-accumulate hooks run once per step, in
    # apply_ (docs/per_sample.md), where plain PyTorch runs them once per backward.
    trunk, heads = _model()
    plain_trunk, plain_heads = copy.deepcopy(trunk), copy.deepcopy(heads)
    for model in (heads, plain_heads):
        for p in model.parameters():
            opt = torch.optim.SGD([p], lr=0.1)

            def hook(param: torch.Tensor, opt: torch.optim.Optimizer = opt) -> None:
                opt.step()
                opt.zero_grad()
            p.register_post_accumulate_grad_hook(hook)
    buf = _buffer(trunk, heads)
    for x, y in _batches(2):  # two steps
        buf.backward(_losses(trunk, heads, x, y))
        buf.apply_(Sum())
        _losses(plain_trunk, plain_heads, x, y).sum().backward()
    for a, b in zip([*trunk.parameters(), *heads.parameters()],
                    [*plain_trunk.parameters(), *plain_heads.parameters()], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        if a.grad is not None or b.grad is not None:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
