"""Data parallel failures on two gloo processes: diagnosed on every rank, bounded, never silent.

Rank 1 disagrees with rank 0 (K, P, mode), skips a step, resumes from another checkpoint or
stalls; every rank raises ``RankAgreementError`` naming what differs, and nothing the user
owns has moved. One process group runs every case (a few seconds); the stall comes last.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ddp import STALL_TIMEOUT_S, _failure_worker, spawn_bounded


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn_bounded(_failure_worker, limit_s=120)


def _raised_everywhere(ranks: list[dict[str, Any]], case: str, *texts: str) -> None:
    for rank in ranks:
        result = rank[case]
        assert result["type"] == "RankAgreementError", (case, result)
        for text in texts:
            assert text in result["text"], (case, text, result["text"])
        assert not result["moved"], case


@pytest.mark.parametrize(("case", "texts"), [
    ("tasks", ["rank 1 has K=3 tasks, rank 0 has K=2 tasks", "nothing was reduced"]),
    ("trunk", ["rank 1 has P=", "shared parameter values, rank 0 has P=", "same trunk"]),
    ("mode", ["rank 1 has mode='gramian', rank 0 has mode='matrix'"]),
])
def test_ranks_with_other_shapes_raise(ranks: list[dict[str, Any]], case: str,
                                       texts: list[str]) -> None:
    _raised_everywhere(ranks, case, *texts)


def test_skipped_apply_raises_instead_of_pairing_with_the_next_step(
        ranks: list[dict[str, Any]]) -> None:
    # rank 1's backward of step 1 adds into step 2; rank 0 is at step 1: both stop there
    _raised_everywhere(ranks, "skip", "rank 1 has 2 backward() call(s) in this step, rank 0 "
                       "has 1", "a rank skipped apply_()")
    assert [rank["skip"]["step"] for rank in ranks] == [1, 2]
    # rank 1 dropped step 1 by reset(): it is one step ahead
    _raised_everywhere(ranks, "reset", "rank 1 is at step 3, rank 0 is at step 2")
    _raised_everywhere(ranks, "reused", "rank 1 is at step 3, rank 0 is at step 2",
                       "rank 1 recomputes the weights, rank 0 reuses cached weights")


def test_other_balancers_or_a_mask_on_one_rank_raise(ranks: list[dict[str, Any]]) -> None:
    _raised_everywhere(ranks, "balancer", "rank 1 applies Sum, rank 0 applies Mean",
                       "the same balancer class")
    _raised_everywhere(ranks, "one_mask", "rank 1 passes active=<a mask>, rank 0 passes "
                       "active=None")


def test_a_clipper_or_a_scaler_on_one_rank_raises(ranks: list[dict[str, Any]]) -> None:
    # the ranks' updates drifted apart (rank 0's 0.03 against rank 1's 0.9; a 16x-scaled
    # mean where rank 0 alone scaled): now refused before anything moves, on every rank
    _raised_everywhere(ranks, "clip", "rank 1 clips with None, rank 0 clips with TaskClip",
                       "the same clip=")
    _raised_everywhere(ranks, "per_sample_clip", "rank 1 clips with None, rank 0 clips with "
                       "TaskClip")
    _raised_everywhere(ranks, "scaler", "rank 1 has no GradScaler, rank 0 scales its losses "
                       "with a GradScaler", "an enabled GradScaler")


def test_each_ranks_mask_is_combined_into_the_global_batchs(
        ranks: list[dict[str, Any]]) -> None:
    # task 1 has labels on rank 0's shard only: active for the global batch, on every rank
    for rank in ranks:
        for own, combined in zip(rank["masks"]["own"], rank["masks"]["combined"]):
            assert torch.equal(own, combined)
    for p, q in zip(ranks[0]["masks"]["own"], ranks[1]["masks"]["own"]):
        assert torch.equal(p, q)
    assert [float(rank["masks"]["weights"][2]) for rank in ranks] == [0.0, 0.0]


def test_a_per_sample_step_dropped_on_one_rank_raises(ranks: list[dict[str, Any]]) -> None:
    _raised_everywhere(ranks, "per_sample_reset", "rank 1 is at step 3, rank 0 is at step 2")
    assert [rank["per_sample_reset"]["step"] for rank in ranks] == [1, 2]


def test_a_per_sample_rank_against_a_task_rank_names_both_modes(
        ranks: list[dict[str, Any]]) -> None:
    _raised_everywhere(ranks, "per_sample_mode",
                       "rank 1 has mode='per_sample', rank 0 has mode='matrix'")
    for rank in ranks:  # the steps' counters differ with the mode: not named as a cause
        assert "<unknown" not in rank["per_sample_mode"]["text"]
        assert "is at step" not in rank["per_sample_mode"]["text"]
        assert "backward() call(s)" not in rank["per_sample_mode"]["text"]


def test_resume_keeps_agreement(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        resume = rank["resume"]
        assert resume["saved_steps"] == [2, 3]
        assert resume["same"]["type"] is None and resume["same"]["steps_begun"] == 5
        assert resume["legacy"]["type"] is None and resume["legacy"]["steps_begun"] == 2
    for p, q in zip(ranks[0]["resume"]["same"]["params"], ranks[1]["resume"]["same"]["params"]):
        assert torch.equal(p, q)
    for rank in ranks:  # rank 1 resumed the step-2 checkpoint, rank 0 the step-3 one
        other = rank["resume"]["other"]
        assert other["type"] == "RankAgreementError" and not other["moved"]
        assert "rank 1 is at step 3, rank 0 is at step 4" in other["text"]


def test_helpers_check_shapes(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        grads, weighting = rank["layout"]["grads"], rank["layout"]["weighting"]
        assert grads["type"] == weighting["type"] == "RankAgreementError"
        assert not grads["moved"] and not weighting["moved"]
        assert "all_reduce_grads_(): the ranks pass different tensors" in grads["text"]
        assert "rank 1 passes 1 tensor(s) (3 values), rank 0 passes 1 tensor(s) (2 " \
               "values)" in grads["text"]
        assert "sync_weighting_(DWA)" in weighting["text"]


def test_stalled_rank_ends_in_an_error_within_the_timeout(ranks: list[dict[str, Any]]) -> None:
    waiting, stalled = ranks[0]["stall"], ranks[1]["stall"]
    for result in (waiting, stalled):
        assert result["type"] == "RankAgreementError" and not result["moved"]
        assert "did not reach the same step" in result["text"]
        assert "init_process_group(timeout=" in result["text"]
    assert "rank 0" in waiting["text"] and "Timed out" in waiting["text"]
    assert 0.8 * STALL_TIMEOUT_S <= waiting["seconds"] <= STALL_TIMEOUT_S + 10
