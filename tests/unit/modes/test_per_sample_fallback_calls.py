"""``batch_dim=0`` through fallback modules called with several arguments, keyword arguments
or tuple outputs (``nn.MultiheadAttention``, ``nn.TransformerEncoderLayer``, ``nn.GRU``),
with dropout, and with a shared argument of batch length (docs/per_sample.md, "Layers").

The reference is a second implementation: the matrix route over the same objectives, each
sample × task loss passed as a task of its own (one backward each), from the same RNG state,
so that dropout draws the same masks in both.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import gradbalance._per_sample_fallback as fallback_module
from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, Balancer, UPGrad


class _Attention(nn.Module):
    """Self-attention with a key padding mask (a keyword argument of batch length)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.inner = nn.MultiheadAttention(8, 2, dropout=dropout, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        padding = torch.zeros(x.shape[:2], dtype=torch.bool)
        padding[:, -1] = True
        return self.inner(x, x, x, key_padding_mask=padding)[0].mean(1)


class _Causal(nn.Module):
    """Two encoder layers under a causal mask ``[T, T]`` (shared by the samples)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=dropout, batch_first=True)
        self.inner = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.inner(x, mask=mask, is_causal=True).mean(1)


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 8, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.gru(x)[0].mean(1)


class _SharedRows(nn.Module):
    """``x · (θ ⊙ Σ_rows s)``: ``s`` ``[B, 8]`` is one tensor for every sample, so splitting
    it by sample (as the vectorised route does with arguments of batch length) is wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.randn(8))

    def forward(self, x: Tensor, s: Tensor) -> Tensor:
        return x * (self.theta * s.sum(0))


class _WithShared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = _SharedRows()
        self.shared = torch.randn(6, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.mean(1), self.shared[: x.shape[0]])


TRUNKS: dict[str, Callable[[], nn.Module]] = {
    "attention": lambda: _Attention(0.0),
    "attention_dropout": lambda: _Attention(0.3),
    "encoder_causal": lambda: _Causal(0.0),
    "encoder_dropout": lambda: _Causal(0.2),
    "gru": _Recurrent,
    "shared_rows": _WithShared,
}


def _update(trunk: nn.Module, heads: nn.Module, x: Tensor, y: Tensor, balancer: Balancer,
            per_sample: bool) -> Tensor:
    params = [*trunk.parameters(), *heads.parameters()]
    for p in params:
        p.grad = None
    kwargs = {"modules": trunk, "batch_dim": 0} if per_sample else {}
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)  # type: ignore[arg-type]
    torch.manual_seed(11)  # the same dropout masks in both routes
    losses = (heads(trunk(x)) - y) ** 2  # [B, K]
    losses = losses[:, 0] if y.shape[1] == 1 else losses
    buf.backward(losses if per_sample else losses.reshape(-1))
    buf.apply_(balancer)
    return torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                      for p in params])


@pytest.mark.parametrize("name", sorted(TRUNKS))
@pytest.mark.parametrize(("balancer", "tasks"), [(MGDA, 1), (UPGrad, 2)])
def test_update_equals_matrix_route(name: str, balancer: Callable[[], Balancer],
                                    tasks: int) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(3)
        trunk, heads = TRUNKS[name](), nn.Linear(8, tasks)
        x, y = torch.randn(5, 4, 8), torch.randn(5, tasks)
        got = _update(trunk, heads, x, y, balancer(), True)
        want = _update(trunk, heads, x, y, balancer(), False)
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(got, want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))


@pytest.mark.parametrize(("name", "masked"), [("attention", False), ("encoder_causal", False),
                                              ("attention_dropout", True), ("gru", True),
                                              ("shared_rows", True)])
def test_the_masked_route_runs_exactly_where_the_vectorised_one_cannot(
        name: str, masked: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout (vmap refuses random ops), a GRU (vmap cannot batch its state updates) and an
    argument shared by the samples (its rows do not add up) take the masked route; other
    calls do not pay for it."""
    calls: list[int] = []
    real = fallback_module._masked
    monkeypatch.setattr(fallback_module, "_masked",
                        lambda *args: calls.append(1) or real(*args))
    torch.manual_seed(3)
    trunk, heads = TRUNKS[name](), nn.Linear(8, 1)
    _update(trunk, heads, torch.randn(5, 4, 8), torch.randn(5, 1), MGDA(), True)
    assert bool(calls) == masked


def test_masked_chunks_equal_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The masked route's lanes in chunks of one output's size give the one-chunk result."""
    torch.set_default_dtype(torch.float64)
    try:
        results = []
        for elements in (1 << 24, 5 * 8):  # one chunk; one lane per chunk
            monkeypatch.setattr(fallback_module, "MASKED_ELEMENTS", elements)
            torch.manual_seed(3)
            trunk, heads = TRUNKS["shared_rows"](), nn.Linear(8, 2)
            results.append(_update(trunk, heads, torch.randn(5, 4, 8), torch.randn(5, 2),
                                   UPGrad(), True))
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(results[0], results[1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["encoder_causal", "gru"])
def test_micro_batches_equal_the_whole_batch(name: str) -> None:
    """Two micro-batches (their cross terms from the first one's kept graph, through the
    vectorised or the masked route) give the matrix route's update on the whole batch."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(3)
        trunk, heads = TRUNKS[name](), nn.Linear(8, 2)
        x, y = torch.randn(5, 4, 8), torch.randn(5, 2)
        want = _update(trunk, heads, x, y, UPGrad(), False)
        params = [*trunk.parameters(), *heads.parameters()]
        for p in params:
            p.grad = None
        buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
        for part in (slice(0, 3), slice(3, 5)):
            buf.backward((heads(trunk(x[part])) - y[part]) ** 2)
        buf.apply_(UPGrad())
        got = torch.cat([p.grad.flatten() for p in params if p.grad is not None])
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(got, want, rtol=1e-8, atol=1e-10 * float(want.abs().max()))
