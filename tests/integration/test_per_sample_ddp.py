"""``batch_dim=0`` on two gloo CPU processes: the per-rank definition (docs/per_sample.md,
"Data parallelism"). Each rank balances the objectives of its own samples and the ranks'
updates are averaged; the reference runs each rank's share through the matrix route (its
samples × tasks passed as tasks) in one process and averages the two updates."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradbalance import TaskGradBuffer
from gradbalance.balancers import UPGrad
from support.ddp import spawn_bounded
from support.per_sample_ddp import GLOBAL_BATCH, losses, model, worker


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn_bounded(worker, world=2, limit_s=120)


def _reference() -> list[torch.Tensor]:
    """The mean of the two shares' matrix-route updates, step by step (``update_every=2``,
    one buffer and one balancer per share, as on the ranks)."""
    trunk, heads, data = model()
    params = [*trunk.parameters(), *heads.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    buffers = [TaskGradBuffer(trunk.parameters(), heads.parameters(), update_every=2,
                              process_group="local") for _ in range(2)]
    balancers = [UPGrad(), UPGrad()]
    share = GLOBAL_BATCH // 2
    out = []
    for x, y in data:
        updates = []
        for r in range(2):
            mine = slice(r * share, (r + 1) * share)
            for p in params:
                p.grad = None
            buffers[r].backward(losses(trunk, heads, x[mine], y[mine]).reshape(-1))
            buffers[r].apply_(balancers[r])
            updates.append(torch.cat([p.grad.flatten() for p in params if p.grad is not None]))
        mean = (updates[0] + updates[1]) / 2
        out.append(mean)
        at = 0
        for p in params:
            p.grad = mean[at: at + p.numel()].reshape(p.shape).clone()
            at += p.numel()
        opt.step()
    return out


def test_every_rank_writes_the_mean_of_the_per_rank_updates(ranks: list[dict[str, Any]]
                                                            ) -> None:
    want = _reference()
    for rank in ranks:
        assert rank["reused"] == [False, True, False]
        assert len(rank["grads"]) == len(want)
        for got, ref in zip(rank["grads"], want):
            assert torch.allclose(got, ref, rtol=1e-9, atol=1e-12 * float(ref.abs().max()))
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["grads"], ranks[1]["grads"]))


def test_ranks_running_other_steps_raise_before_anything_moves(ranks: list[dict[str, Any]]
                                                              ) -> None:
    for rank in ranks:
        result = rank["disagree"]
        assert result["type"] == "RankAgreementError", result
        assert "rank 1 has update_every=3, rank 0 has update_every=2" in result["text"]
        assert not result["moved"]
