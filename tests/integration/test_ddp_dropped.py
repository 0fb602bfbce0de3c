"""Dropped steps under data parallelism, on two gloo processes (docs/distributed.md): a batch
every rank drops, each wherever it failed, leaves their step counts equal (they were one
apart, and every later ``apply_`` raised); a balancer that fails on one rank with
``batch_dim=0`` makes every rank raise at once, nothing written (the others waited for the
group's timeout); a per-sample buffer's cached weights are refused on another rank (they
loaded, and the resumed run left the saved one's)."""

from __future__ import annotations

from typing import Any

import pytest

from support.ddp import spawn_bounded
from support.ddp_dropped import dropped_worker


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn_bounded(dropped_worker, limit_s=120)


def test_a_batch_every_rank_drops_keeps_their_steps_equal(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["agreed_skip"]["errors"] == []
    assert ranks[0]["agreed_skip"]["steps_begun"] == ranks[1]["agreed_skip"]["steps_begun"] == 4


def test_a_balancer_failing_on_one_rank_raises_on_every_rank_at_once(
        ranks: list[dict[str, Any]]) -> None:
    assert ranks[1]["solver"]["kind"] == "SolverError"
    assert ranks[0]["solver"]["kind"] == "RankAgreementError"
    for rank in ranks:  # rank 0's is the library's error, not the group's timeout
        assert rank["solver"]["untouched"]


def test_a_per_sample_state_is_refused_on_another_rank(ranks: list[dict[str, Any]]) -> None:
    for r, rank in enumerate(ranks):
        assert rank["state"]["rank_saved"] == r
        assert "each rank caches the weights of its own samples" in rank["state"]["refused"]
