"""The multi-process tests' runner (``support.ddp.spawn_bounded``): a rank that hangs before
saving its result fails the call; one stuck after every rank saved (torch 2.6's gloo
teardown, docs/distributed.md) is killed and the results returned."""

from __future__ import annotations

import os
import time

import pytest
import torch

from support import ddp


def _saves_then_hangs(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.save({"rank": rank}, os.path.join(out_dir, f"rank{rank}.pt"))
    if rank == 0:
        time.sleep(600)  # stuck after its result, as a teardown would be


def _hangs_before_saving(rank: int, world: int, init_file: str, out_dir: str) -> None:
    if rank == 1:
        time.sleep(600)
    torch.save({"rank": rank}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_a_rank_stuck_after_every_result_is_saved_is_accepted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ddp, "TEARDOWN_GRACE_S", 0.5)
    results = ddp.spawn_bounded(_saves_then_hangs, world=2, limit_s=60)
    assert [r["rank"] for r in results] == [0, 1]


def test_a_rank_stuck_before_its_result_fails_the_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ddp, "TEARDOWN_GRACE_S", 0.5)
    # Rank 1 must be named; rank 0 may be too when, on a loaded machine, starting a spawned
    # interpreter and importing torch takes longer than the limit.
    with pytest.raises(AssertionError, match=r"ranks \[(0, )?1\] still ran after 8 s: a hang"):
        ddp.spawn_bounded(_hangs_before_saving, world=2, limit_s=8)
