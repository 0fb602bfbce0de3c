"""Small trunks for the per-sample (``batch_dim=0``) tests: each returns ``[B, 8]`` features."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


class Tokens(nn.Module):
    """Embedding, LayerNorm, a Conv1d over the sequence and a Linear on 3-D input."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=0)
        self.norm = nn.LayerNorm(6)
        self.conv = nn.Conv1d(6, 6, 3, padding=1)
        self.out = nn.Linear(6, 8)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.norm(self.embed(ids))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return torch.tanh(self.out(h)).mean(1)


class Gate(nn.Module):
    """A parameter used in a non-linear way: no outer form, the torch.func fallback."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w + torch.sin(x * self.w)


class Attention(nn.Module):
    """A one-block transformer over ``[B, S, 6]``: q, k, v and out projections (3-D Linear),
    LayerNorm, a feed-forward, mean pooling; attention mixes positions, never samples."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(6, 6) for _ in range(4))
        self.norm1, self.norm2 = nn.LayerNorm(6), nn.LayerNorm(6)
        self.ff = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
        self.out = nn.Linear(6, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        scores = self.q(h) @ self.k(h).transpose(1, 2) / 6 ** 0.5
        x = x + self.o(scores.softmax(-1) @ self.v(h))
        x = x + self.ff(self.norm2(x))
        return self.out(x).mean(1)


def attention() -> tuple[nn.Module, Callable[[int], Tensor]]:
    return Attention(), lambda b: torch.randn(b, 5, 6)


def mlp() -> tuple[nn.Module, Callable[[int], Tensor]]:
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8))
    return model, lambda b: torch.randn(b, 5)


def cnn() -> tuple[nn.Module, Callable[[int], Tensor]]:
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.Conv2d(3, 4, 3, stride=2),
                          nn.Flatten(), nn.Linear(16, 8))
    return model, lambda b: torch.randn(b, 2, 6, 6)


def tokens() -> tuple[nn.Module, Callable[[int], Tensor]]:
    return Tokens(), lambda b: torch.randint(0, 11, (b, 4))


def mixed() -> tuple[nn.Module, Callable[[int], Tensor]]:
    """Covered layers between uncovered ones (a custom gate, GroupNorm, eval BatchNorm)."""
    bn = nn.BatchNorm1d(8)
    bn.running_mean.uniform_(-0.5, 0.5)
    bn.running_var.uniform_(0.5, 2.0)
    bn.eval()
    model = nn.Sequential(Gate(5), nn.Linear(5, 8), nn.GroupNorm(2, 8), nn.Tanh(), bn,
                          nn.Linear(8, 8))
    return model, lambda b: torch.randn(b, 5)


TRUNKS = {"mlp": mlp, "cnn": cnn, "tokens": tokens, "mixed": mixed, "attention": attention}
