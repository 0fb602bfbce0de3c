"""Workers of the data-parallel loss-weighting tests: each rank weights its shard's losses and
the ranks' averaged gradients are compared with one process's on the global batch."""

from __future__ import annotations

import datetime
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum
from gradbalance.distributed import RankAgreementError, all_reduce_grads_, global_losses
from gradbalance.integrations._core import BalancedParts
from gradbalance.weighting import get_weighting
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

K = 3
#: The weightings whose weights read the losses of the call, with their arguments.
WEIGHTINGS = {"gls": {}, "si": {}, "stch": {}, "stch_nadir": {"nadir": [0.5, 2.0, 0.1]},
              "famo": {}}
SHARD = 4


def _model() -> MultiTaskModel:
    torch.manual_seed(0)
    return MultiTaskModel(mlp_trunk(6, 8, 2), make_heads(8, K)).double()


def _batch(world: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(SHARD * world, 6, generator=gen, dtype=torch.float64)
    y = torch.randn(SHARD * world, K, generator=gen, dtype=torch.float64)
    return x, y * torch.tensor([1.0, 5.0, 0.2], dtype=torch.float64)  # losses far apart


def _weighting(key: str) -> Any:
    return get_weighting(key.split("_")[0], num_tasks=K, **WEIGHTINGS[key])


def _grads(model: MultiTaskModel) -> list[Tensor]:
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    model.zero_grad(set_to_none=True)
    return grads


def _single(key: str, world: int) -> list[Tensor]:
    """The single-process gradient on the global batch (before the process group exists)."""
    x, y = _batch(world)
    model = _model()
    _weighting(key)(regression_losses(model(x), y)).sum().backward()
    return _grads(model)


def _case(key: str, rank: int, world: int, single: list[Tensor]) -> dict[str, Any]:
    """The averaged ranks' gradients three ways: this rank's own losses, ``global_losses``,
    and the integrations' core; with ``single``, one process's."""
    x, y = _batch(world)
    shard = slice(SHARD * rank, SHARD * (rank + 1))
    model = _model()
    out: dict[str, Any] = {"single": single}
    for route in ("own", "global"):
        losses = regression_losses(model(x[shard]), y[shard])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            given = global_losses(losses) if route == "global" else losses
            _weighting(key)(given).sum().backward()
        all_reduce_grads_(list(model.parameters()))  # what DDP's reducer does
        out[route] = _grads(model)
        out[f"{route}_warned"] = [str(w.message) for w in caught]
    weighting = _weighting(key)
    if weighting.needs_losses_after:  # FAMO: refused by the integrations (tested apart)
        return out
    buffer = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    parts = BalancedParts(Sum(), buffer, weighting=weighting)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parts.backward(regression_losses(model(x[shard]), y[shard]), 1, None)
        parts.step(None)
    out["parts"] = _grads(model)
    out["parts_warned"] = [str(w.message) for w in caught]
    return out


def _mismatch(rank: int) -> dict[str, Any]:
    """Rank 1 passes one loss more than rank 0."""
    try:
        global_losses(torch.ones(K + rank, dtype=torch.float64))
    except RankAgreementError as error:
        return {"type": "RankAgreementError", "text": str(error)}
    return {"type": None, "text": ""}


def weighting_worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    singles = {key: _single(key, world) for key in WEIGHTINGS}
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    results: dict[str, Any] = {key: _case(key, rank, world, singles[key]) for key in WEIGHTINGS}
    results["mismatch"] = _mismatch(rank)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # the result is saved: gloo's teardown waits seconds for nothing
