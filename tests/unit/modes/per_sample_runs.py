"""A few steps of the per-sample route (``batch_dim=0``) or of its reference, the matrix
route over the same objectives (each sample, or sample × task, passed as a task)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from gradbalance import StepStats, TaskGradBuffer
from gradbalance.balancers import Balancer

from .per_sample_models import TRUNKS


def flat_grads(params: list[Tensor]) -> Tensor:
    return torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                      for p in params])


def models(name: str, tasks: int, seed: int) -> tuple[nn.Module, nn.Module,
                                                        Callable[[int], Tensor]]:
    torch.manual_seed(seed)
    trunk, inputs = TRUNKS[name]()
    return trunk, nn.Linear(8, tasks), inputs


def losses_of(trunk: nn.Module, heads: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """``[B]`` when ``y`` has one column, else ``[B, K]``; unreduced."""
    losses = (heads(trunk(x)) - y) ** 2
    return losses[:, 0] if y.shape[1] == 1 else losses


def run(trunk: nn.Module, heads: nn.Module, batches: list[tuple[Tensor, Tensor]],
        balancer: Balancer, per_sample: bool, clip: Any = None,
        **options: Any) -> tuple[list[Tensor], list[StepStats]]:
    """One step per batch (``.grad`` zeroed before each); the update of each step (trunk
    then heads) and its statistics."""
    params = [*trunk.parameters(), *heads.parameters()]
    kwargs = {"modules": trunk, "batch_dim": 0} if per_sample else {}
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs, **options)
    updates, stats = [], []
    try:
        for x, y in batches:
            for p in params:
                p.grad = None
            losses = losses_of(trunk, heads, x, y)
            buf.backward(losses if per_sample else losses.reshape(-1))
            stats.append(buf.apply_(balancer, clip=clip))
            updates.append(flat_grads(params))
    finally:
        if buf._per_sample is not None:
            buf._per_sample.gramian.remove()
    return updates, stats


def batches(inputs: Callable[[int], Tensor], sizes: list[int],
            tasks: int) -> list[tuple[Tensor, Tensor]]:
    return [(inputs(b), torch.randn(b, tasks)) for b in sizes]


def close(got: list[Tensor], want: list[Tensor]) -> bool:
    return len(got) == len(want) and all(
        torch.allclose(a, b, rtol=1e-8, atol=1e-10 * float(b.abs().max()))
        for a, b in zip(got, want))
