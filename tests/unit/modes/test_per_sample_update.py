"""``batch_dim=0``'s update from the layers' kept operands (``gradbalance._per_sample_update``).

With one micro-batch and every trunk layer recorded, ``apply_`` writes ``Σ wᵢₖ ∇ℓᵢₖ`` from the
output gradients of the Gramian's backward instead of a second backward. The reference is that
backward: ``autograd.grad`` of ``Σ wᵢₖ ℓᵢₖ`` for the same weights (``Constant``, signs mixed).
"""

from __future__ import annotations

from collections.abc import Callable

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
