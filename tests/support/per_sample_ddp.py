"""The per-sample route (``batch_dim=0``) on several gloo ranks: each rank balances its own
samples, the written gradients are the ranks' mean (docs/per_sample.md, "Data
parallelism"). ``run(rank, world, samples)`` trains the same model on the same global
batches, rank ``r`` taking its slice; ``world=1, samples=slice`` runs one rank's share alone
for the reference."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import UPGrad

GLOBAL_BATCH = 8
STEPS = 3
TASKS = 2


def model() -> tuple[nn.Module, nn.Module, list[tuple[Tensor, Tensor]]]:
    """The trunk, the heads and the global batches, alike on every rank (float64)."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 8)).double()
    heads = nn.Linear(8, TASKS).double()
    data = [(torch.randn(GLOBAL_BATCH, 5, generator=generator, dtype=torch.float64),
             torch.randn(GLOBAL_BATCH, TASKS, generator=generator, dtype=torch.float64))
            for _ in range(STEPS)]
    return trunk, heads, data


def losses(trunk: nn.Module, heads: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (heads(trunk(x)) - y) ** 2  # [B, K]


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    trunk, heads, data = model()
    params = [*trunk.parameters(), *heads.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0,
                         update_every=2)
    balancer = UPGrad()
    share = GLOBAL_BATCH // world
    grads, reused = [], []
    for x, y in data:
        mine = slice(rank * share, (rank + 1) * share)
        buf.backward(losses(trunk, heads, x[mine], y[mine]))
        stats = buf.apply_(balancer)
        reused.append(stats.weights_reused)
        grads.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
        opt.step()
        opt.zero_grad()
    torch.save({"grads": grads, "reused": reused, "disagree": _disagreeing(rank, world)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def _disagreeing(rank: int, world: int) -> dict[str, object]:
    """Rank r builds its buffer with ``update_every=2 + r``: every rank raises before
    anything moves."""
    trunk, heads, data = model()
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0,
                         update_every=2 + rank)
    x, y = data[0]
    share = GLOBAL_BATCH // world
    buf.backward(losses(trunk, heads, x[rank * share:(rank + 1) * share],
                        y[rank * share:(rank + 1) * share]))
    try:
        buf.apply_(UPGrad())
    except Exception as error:  # the test reads the type and the text
        moved = any(p.grad is not None for p in [*trunk.parameters(), *heads.parameters()])
        return {"type": type(error).__name__, "text": str(error), "moved": moved}
    return {"type": None, "text": "", "moved": True}
