"""``mode="auto"`` over two gloo ranks: the training run of ``tests/integration/test_ddp_auto.py``.

Each rank trains the same model (same seed) on its shard of the same global batches, two
micro-batches per step; :func:`train` with ``world=1`` on the full batch is the reference.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from gradbalance import TaskGradBuffer
from gradbalance.balancers import UPGrad
from gradbalance.distributed import RankAgreementError
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

K = 3
GLOBAL_BATCH = 16
STEPS = 4


def _model(width: int) -> MultiTaskModel:
    torch.manual_seed(0)
    return MultiTaskModel(mlp_trunk(8, width, 2), make_heads(width, K)).double()


def train(width: int, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """``STEPS`` SGD steps of UPGrad in ``mode="auto"``; parameters, routes, layer routes."""
    model = _model(width)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="auto",
                         modules=model.trunk)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    balancer = UPGrad()
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, GLOBAL_BATCH, 8, generator=gen, dtype=torch.float64)
    ys = torch.randn(STEPS, GLOBAL_BATCH, K, generator=gen, dtype=torch.float64)
    shard = GLOBAL_BATCH // world
    routes, layers = [], []
    for step in range(STEPS):
        x = xs[step, rank * shard : (rank + 1) * shard]
        y = ys[step, rank * shard : (rank + 1) * shard]
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            buf.backward(regression_losses(model(xm), ym) / 2)
        stats = buf.apply_(balancer)
        routes.append(stats.route)
        layers.append(buf.layer_routes)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": [p.detach().clone() for p in model.parameters()], "routes": routes,
            "layers": layers}


def train_gramian(force: Any = None, rank: int = 0, world: int = 1) -> dict[str, Any]:
    """``STEPS`` steps of ``mode="gramian"`` (width 64) with ``force`` on every layer, each
    rank its own (``force`` a callable of the rank), two micro-batches per step."""
    model = _model(64)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="gramian",
                         modules=model.trunk)
    buf._engine.recorder.force = force(rank) if callable(force) else force  # type: ignore[attr-defined]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(STEPS, GLOBAL_BATCH, 8, generator=gen, dtype=torch.float64)
    ys = torch.randn(STEPS, GLOBAL_BATCH, K, generator=gen, dtype=torch.float64)
    shard = GLOBAL_BATCH // world
    layers = []
    for step in range(STEPS):
        x = xs[step, rank * shard : (rank + 1) * shard]
        y = ys[step, rank * shard : (rank + 1) * shard]
        for xm, ym in zip(x.chunk(2), y.chunk(2)):
            buf.backward(regression_losses(model(xm), ym) / 2)
        buf.apply_(UPGrad())
        layers.append(buf.layer_routes)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"params": [p.detach().clone() for p in model.parameters()], "layers": layers}


def _rank_route(rank: int) -> str:
    return "rows" if rank == 0 else "activations"


def _unequal_shapes(rank: int) -> str:
    """Rank 0 takes 4 rows, rank 1 takes 200: the model picks gramian on one, matrix on the
    other (the first step takes matrix on both: the balancer is not known yet)."""
    model = _model(64)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="auto",
                         modules=model.trunk)
    rows = 4 if rank == 0 else 200
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(rows, K, generator=gen, dtype=torch.float64)
    buf.backward(regression_losses(model(x), y))
    buf.apply_(UPGrad())
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    buf.backward(regression_losses(model(x), y))
    try:
        buf.apply_(UPGrad())
    except RankAgreementError as error:
        moved = not all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
        return f"{error} | grads moved: {moved}"
    return ""


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    """The target of ``support.ddp.spawn_bounded``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        results = {width: train(width, rank, world) for width in (16, 64)}
        results["unequal"] = _unequal_shapes(rank)
        results["mixed"] = train_gramian(_rank_route, rank, world)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
