"""Helpers of the gradient-mode tests: one balanced step per mode on a fresh model."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from gradbalance import BALANCERS, TaskGradBuffer
from gradbalance.balancers import Balancer
from support.helpers import build, grads_of, losses_of


def default_weighted() -> list[str]:
    """Registry names of the weighted balancers that build without arguments."""
    names = []
    for name, cls in sorted(BALANCERS.items()):
        if not cls.from_gramian:
            continue
        try:
            cls()
        except TypeError:
            continue
        names.append(name)
    return names


def make_balancer(name: str, seed: int = 0) -> Balancer:
    """A fresh balancer; a seeded global RNG makes the random ones repeatable."""
    torch.manual_seed(seed)
    if name == "constant":
        return BALANCERS[name]([0.5, 2.0, -1.0])  # type: ignore[call-arg]
    return BALANCERS[name]()


def step(kind: str, balancer: Balancer, mode: str, *, num_tasks: int = 3, seed: int = 0,
         dtype: torch.dtype = torch.float64, scaler: Any = None,
         **kwargs: Any) -> tuple[list[Tensor], list[Tensor], Any]:
    """One balanced step in ``mode``; returns trunk grads, head grads and the stats."""
    model, x, y = build(kind, num_tasks=num_tasks, seed=seed, dtype=dtype)
    if mode == "gramian":
        kwargs.setdefault("modules", model.trunk)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                         **kwargs)
    feats = model.trunk(x)
    losses = losses_of_features(model, feats, y)
    buf.backward(losses, scaler=scaler, features=feats if mode == "features" else None)
    stats = buf.apply_(balancer, scaler=scaler)
    return grads_of(model.shared_parameters()), grads_of(model.head_parameters()), stats


def losses_of_features(model: Any, feats: Tensor, y: Tensor) -> Tensor:
    from gradbalance_lab.models import regression_losses

    return regression_losses([head(feats) for head in model.heads], y)


__all__ = ["default_weighted", "losses_of", "make_balancer", "step"]
