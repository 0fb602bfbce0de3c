"""Helpers for the loss-weighting tests: a tiny multitask model and one factory per method."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from gradbalance.weighting import WEIGHTINGS, LossWeighting

K = 3


class Tiny(nn.Module):
    """Two shared linear layers and K linear heads; ``losses(x, y)`` gives MSE means ``[K]``."""

    def __init__(self, seed: int = 0, d: int = 5, h: int = 6, k: int = K,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(h, 1) for _ in range(k)])
        self.to(dtype)

    def losses(self, x: Tensor, y: Tensor) -> Tensor:
        f = self.trunk(x)
        return torch.stack([((head(f).squeeze(1) - y[:, k]) ** 2).mean()
                            for k, head in enumerate(self.heads)])


def data(seed: int = 0, n: int = 16, d: int = 5, k: int = K,
         dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=dtype)
    y = torch.randn(n, k, generator=g, dtype=dtype) * torch.tensor([1.0, 3.0, 10.0][:k] + [
        1.0] * max(0, k - 3), dtype=dtype)
    return x, y


def make(name: str, model: Tiny | None = None, k: int = K) -> LossWeighting:
    """A weighting of each registered kind with settings that make every state move."""
    if name == "gradnorm":
        assert model is not None
        return WEIGHTINGS[name](k, model.trunk)
    if name == "rlw":
        return WEIGHTINGS[name](k, seed=3)
    if name == "stch":
        return WEIGHTINGS[name](k, mu=0.5, warmup_steps=2)
    if name == "dwa":
        return WEIGHTINGS[name](k, period=2)
    params = list(inspect.signature(WEIGHTINGS[name]).parameters.values())[1:]
    missing = [p.name for p in params if p.default is p.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if missing:
        pytest.fail(f"{name} needs {missing} besides num_tasks: add its settings to "
                    f"support.weighting.make (docs/ARCHITECTURE.md, \"Extension contract\", "
                    f"\"Registered by name\")")
    return WEIGHTINGS[name](k)


def user_optimizer(weighting: LossWeighting, model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam([*model.parameters(), *weighting.parameters()], lr=0.05)


def train_step(weighting: LossWeighting, model: Tiny, opt: torch.optim.Optimizer,
               x: Tensor, y: Tensor,
               after: Callable[[], Tensor] | None = None) -> Tensor:
    """One plain-loop step with the weighting; returns the weighted losses."""
    weighted = weighting(model.losses(x, y))
    opt.zero_grad()
    weighted.sum().backward()
    opt.step()
    if weighting.name == "famo":
        with torch.no_grad():
            weighting.update(model.losses(x, y))
    else:
        weighting.update()
    return weighted.detach()


def state_tensors(obj: object) -> list[Tensor]:
    """Every tensor in a (nested) state dict, in a fixed order."""
    out: list[Tensor] = []

    def walk(v: object) -> None:
        if isinstance(v, Tensor):
            out.append(v)
        elif isinstance(v, dict):
            for key in sorted(v, key=str):
                walk(v[key])
        elif isinstance(v, (list, tuple)):
            for item in v:
                walk(item)

    walk(obj)
    return out


def assert_states_equal(a: dict, b: dict) -> None:
    ta, tb = state_tensors(a), state_tensors(b)
    assert len(ta) == len(tb)
    for u, v in zip(ta, tb):
        assert torch.equal(u, v), (u, v)
    assert {k for k in a} == {k for k in b}
    for key in a:
        if not isinstance(a[key], (Tensor, dict)):
            assert a[key] == b[key], key
