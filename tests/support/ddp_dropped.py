"""Workers of the data-parallel dropped-step tests: a batch dropped on every rank, each
wherever it failed; a balancer that fails on one rank with ``batch_dim=0``; a per-sample
buffer state loaded on another rank."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from gradbalance import SolverError, TaskGradBuffer
from gradbalance.balancers import UPGrad
from gradbalance.distributed import RankAgreementError


def _model() -> tuple[nn.Module, nn.ModuleList]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 5)).double()
    heads = nn.ModuleList([nn.Linear(5, 1) for _ in range(2)]).double()
    return trunk, heads


def _losses(trunk: nn.Module, heads: nn.ModuleList, x: Tensor, y: Tensor) -> Tensor:
    f = trunk(x)
    return torch.stack([((h(f)[:, 0] - y[:, k]) ** 2).mean() for k, h in enumerate(heads)])


def _agreed_skip(rank: int) -> dict[str, Any]:
    """Rank 1's batch 1 fails in its forward, before any backward; rank 0's after its first
    micro-batch. Both drop it together (``reset(keep_weights=True)``) and go on."""
    trunk, heads = _model()
    buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()))
    opt = torch.optim.SGD([*trunk.parameters(), *heads.parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(10 + rank)
    errors = []
    for step in range(4):
        x = torch.randn(4, 4, generator=gen, dtype=torch.float64)
        y = torch.randn(4, 2, generator=gen, dtype=torch.float64)
        failed = False
        try:
            for m, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
                if step == 1 and m == rank:
                    raise RuntimeError("injected")
                buf.backward(_losses(trunk, heads, xm, ym) / 2)
        except RuntimeError:
            failed = True
        ok = torch.tensor([int(not failed)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not int(ok):
            opt.zero_grad(set_to_none=True)
            buf.reset(keep_weights=True)
            continue
        try:
            buf.apply_(UPGrad())
        except RankAgreementError as error:
            errors.append(str(error))
            break
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"errors": errors, "steps_begun": buf.state_dict()["steps_begun"]}


class _Flaky(UPGrad):
    fail = False

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        if self.fail and dist.get_rank() == 1:
            raise SolverError("injected")
        return super()._compute_weights(gramian, losses)


def _one_rank_solver_fails(rank: int) -> dict[str, Any]:
    trunk, heads = _model()
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    bal = _Flaky()
    bal.fail = True
    gen = torch.Generator().manual_seed(20 + rank)
    x = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(3, 2, generator=gen, dtype=torch.float64)
    f = trunk(x)
    buf.backward(torch.stack([(h(f)[:, 0] - y[:, k]) ** 2 for k, h in enumerate(heads)], 1))
    kind = None
    try:
        buf.apply_(bal)
    except (SolverError, RankAgreementError) as error:
        kind = type(error).__name__
    grads = [p.grad for p in [*trunk.parameters(), *heads.parameters()]]
    return {"kind": kind, "untouched": all(g is None for g in grads)}


def _state_on_another_rank(rank: int) -> dict[str, Any]:
    trunk, heads = _model()
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0,
                         update_every=2)
    gen = torch.Generator().manual_seed(30 + rank)
    x = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(3, 2, generator=gen, dtype=torch.float64)
    f = trunk(x)
    buf.backward(torch.stack([(h(f)[:, 0] - y[:, k]) ** 2 for k, h in enumerate(heads)], 1))
    buf.apply_(UPGrad())
    mine = buf.state_dict()
    states: list[Any] = [None, None]
    dist.all_gather_object(states, mine)
    other = states[1 - rank]
    text = None
    try:
        buf.load_state_dict(other)
    except ValueError as error:
        text = str(error)
    buf.load_state_dict(mine)  # its own: accepted
    return {"refused": text, "rank_saved": mine.get("rank")}


def dropped_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    results = {"agreed_skip": _agreed_skip(rank), "solver": _one_rank_solver_fails(rank),
               "state": _state_on_another_rank(rank)}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # the result is saved: gloo's teardown waits seconds for nothing
