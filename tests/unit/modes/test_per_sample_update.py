"""``batch_dim=0``'s update from the layers' kept operands (``gradbalance._per_sample_update``).

With one micro-batch and every trunk layer recorded, ``apply_`` writes ``Σ wᵢₖ ∇ℓᵢₖ`` from the
output gradients of the Gramian's backward instead of a second backward. The reference is that
backward: ``autograd.grad`` of ``Σ wᵢₖ ℓᵢₖ`` for the same weights (``Constant``, signs mixed).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, Constant

from .per_sample_models import TRUNKS


class Reused(nn.Module):
    """One Linear called twice (two calls along S), a LayerNorm and a Conv1d with dilation."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)
        self.conv = nn.Conv1d(1, 2, 3, stride=2, dilation=2, padding=3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(torch.tanh(self.lin(self.norm(x))))
        return self.conv(h.unsqueeze(1)).flatten(1)[:, :8]


MODELS: dict[str, Callable[[], tuple[nn.Module, Callable[[int], Tensor]]]] = {
    **{name: TRUNKS[name] for name in ("mlp", "cnn", "tokens", "attention")},
    "reused": lambda: (Reused(), lambda b: torch.randn(b, 8)),
}


def _losses(trunk: nn.Module, heads: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    losses = (heads(trunk(x)) - y) ** 2
    return losses[:, 0] if y.shape[1] == 1 else losses


@settings(max_examples=15, deadline=None)
@given(name=st.sampled_from(sorted(MODELS)), batch=st.integers(1, 6), tasks=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_update_equals_weighted_backward(name: str, batch: int, tasks: int, seed: int) -> None:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.float64)
        try:
            trunk, inputs = MODELS[name]()
            heads = nn.Linear(8, tasks)
            x, y = inputs(batch), torch.randn(batch, tasks)
            w = torch.randn(batch * tasks)
        finally:
            torch.set_default_dtype(torch.float32)
    params = list(trunk.parameters())
    want = torch.autograd.grad((_losses(trunk, heads, x, y).reshape(-1) * w).sum(), params)
    buf = TaskGradBuffer(params, heads.parameters(), modules=trunk, batch_dim=0)
    buf.backward(_losses(trunk, heads, x, y))
    buf.apply_(Constant(w))
    for p, g in zip(params, want):
        assert p.grad is not None
        assert torch.allclose(p.grad, g, rtol=1e-10, atol=1e-12)


def _backward_runs(micro: int) -> int:
    """How often ``apply_``'s backward reaches the trunk's first layer output."""
    torch.manual_seed(0)
    first = nn.Linear(5, 8)
    trunk = nn.Sequential(first, nn.Tanh(), nn.Linear(8, 1))
    runs = [0]

    def count(_m: nn.Module, _i: object, out: Tensor) -> None:
        out.register_hook(lambda g: runs.__setitem__(0, runs[0] + 1))

    first.register_forward_hook(count)
    buf = TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=0)
    for _ in range(micro):
        buf.backward(trunk(torch.randn(4, 5))[:, 0] ** 2)
    before = runs[0]
    buf.apply_(MGDA())
    return runs[0] - before


def test_one_micro_batch_of_recorded_layers_runs_no_second_backward() -> None:
    assert _backward_runs(1) == 0
    assert _backward_runs(2) == 2  # micro-batches: one weighted backward each


@pytest.mark.parametrize(("name", "seed"), [("mlp", 0), ("cnn", 1), ("tokens", 2),
                                            ("reused", 4)])
def test_grads_taken_without_a_copy_are_the_parameters_own(name: str, seed: int) -> None:
    """The update from the kept operands becomes ``.grad`` without a copy: each ``.grad``
    has its parameter's strides, a storage of its own size shared with no other ``.grad``,
    and editing it in place changes nothing the next step computes (its reference: the
    same second step on a copy of the model whose ``.grad`` were never edited)."""
    torch.manual_seed(seed)
    trunk, inputs = MODELS[name]()
    heads = nn.Linear(8, 2)
    twin, twin_heads = copy.deepcopy(trunk), copy.deepcopy(heads)
    batches = [(inputs(4), torch.randn(4, 2)) for _ in range(2)]

    def step(model: nn.Module, head: nn.Module, batch: tuple[Tensor, Tensor],
             buf: TaskGradBuffer) -> None:
        buf.backward(_losses(model, head, *batch))
        buf.apply_(MGDA())

    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    step(trunk, heads, batches[0], buf)
    grads = [p.grad for p in trunk.parameters() if p.grad is not None]
    assert grads
    for p in trunk.parameters():
        if p.grad is not None:
            assert p.grad.stride() == p.stride()
            assert p.grad.untyped_storage().nbytes() == p.grad.numel() * p.grad.element_size()
    assert len({g.untyped_storage().data_ptr() for g in grads}) == len(grads)
    for g in grads:
        g.zero_()  # zero_grad(set_to_none=False): in place
    step(trunk, heads, batches[1], buf)
    twin_buf = TaskGradBuffer(twin.parameters(), twin_heads.parameters(), modules=twin,
                              batch_dim=0)
    for p in twin.parameters():
        p.grad = torch.zeros_like(p)
    step(twin, twin_heads, batches[1], twin_buf)
    for p, q in zip(trunk.parameters(), twin.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.grad, q.grad)
