"""The three models of ``benchmarks/per_sample.py``: an MLP, a CNN and a small transformer.

Each maps a batch of B inputs to ``[B, K]`` (``build(K)``, K = 1 by default); the per-sample
losses are ``(f(x) - y)²``, ``[B]`` or ``[B, K]``.
Every parameter lives in a layer the per-sample Gramian covers (docs/per_sample.md, "Layers"):
``nn.Linear`` (2-D and 3-D inputs), ``nn.Conv2d``, ``nn.Embedding``, ``nn.LayerNorm``; the
transformer's attention is written with ``nn.Linear`` projections, which the Gram forms cover
(``nn.MultiheadAttention`` takes the slower ``torch.func`` fallback).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["MODELS", "Model"]

#: name -> (model builder ``(K outputs) -> model``, input builder ``(B, generator) -> x``)
Model = tuple[Callable[..., nn.Module], Callable[[int, torch.Generator], Tensor]]


class SelfAttention(nn.Module):
    """Multi-head self-attention over ``[B, S, d]`` from four ``nn.Linear`` projections."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, s, d = x.shape

        def split(t: Tensor) -> Tensor:
            return t.view(b, s, self.heads, d // self.heads).transpose(1, 2)

        q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
        mixed = ((q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5).softmax(-1) @ v
        return self.o(mixed.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    """Pre-norm transformer block: attention and a GELU feed-forward of width 4d."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class Transformer(nn.Module):
    """Token embedding + learned positions, ``depth`` blocks, mean pooling, a linear output."""

    def __init__(self, vocab: int, length: int, d: int, heads: int, depth: int,
                 outputs: int = 1) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(length, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(depth)))
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, outputs)

    def forward(self, ids: Tensor) -> Tensor:
        # positions per sample ([B, S]): every layer input keeps the batch as dim 0
        h = self.embed(ids) + self.pos(torch.arange(ids.shape[1]).expand_as(ids))
        return self.out(self.norm(self.blocks(h)).mean(1))


def _mlp(width: int) -> Model:
    return (lambda k=1: nn.Sequential(nn.Linear(128, width), nn.ReLU(), nn.Linear(width, width),
                                      nn.ReLU(), nn.Linear(width, k)),
            lambda b, g: torch.randn(b, 128, generator=g))


def _cnn(c: int, side: int) -> Model:
    return (lambda k=1: nn.Sequential(
                nn.Conv2d(3, c, 3, padding=1), nn.ReLU(),
                nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU(),
                nn.Conv2d(2 * c, 2 * c, 3, stride=2, padding=1), nn.ReLU(),
                nn.Flatten(), nn.Linear(2 * c * (side // 4) ** 2, k)),
            lambda b, g: torch.randn(b, 3, side, side, generator=g))


def _transformer(vocab: int, length: int, d: int, depth: int) -> Model:
    return (lambda k=1: Transformer(vocab, length, d, 4, depth, k),
            lambda b, g: torch.randint(0, vocab, (b, length), generator=g))


#: The benchmark's models (``quick``: tiny ones for the smoke run).
MODELS: dict[bool, dict[str, Model]] = {
    False: {"mlp": _mlp(768), "cnn": _cnn(32, 32), "transformer": _transformer(1000, 32, 64, 2)},
    True: {"mlp": _mlp(16), "cnn": _cnn(4, 8), "transformer": _transformer(50, 6, 8, 1)},
}
