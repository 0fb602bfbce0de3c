"""The balanced step on a trunk sharded with FSDP2 (``fully_shard``) on 2 and 4 gloo ranks.

Every sharded run must give the single-process full-batch run's parameters, statistics and
balancer state (to 1e-6 relative, float32), and every rank the same; the reference is the
same model unsharded, trained on the whole batch (docs/distributed.md, "Sharded trunks").
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from gradbalance.balancers import MGDA, GradVac, NashMTL, PCGrad, Sum, UPGrad
from gradbalance.clip import TaskAutoClip, TaskClip, TaskValueClip
from support.ddp import spawn_bounded
from support.fsdp import (
    Case,
    assert_close_runs,
    assert_resumed_bit_identical,
    dbmtl,
    graddrop,
    gradnorm,
    run_all_worker,
    train,
)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is unavailable")

CASES = [
    Case("pcgrad", PCGrad),
    Case("mgda_root_sharded_heads", MGDA, wrap="root", heads_sharded=True),
    Case("upgrad", UPGrad),
    Case("nash_mtl", functools.partial(NashMTL, 3)),
    Case("gradvac", functools.partial(GradVac, 3)),
    Case("amp_overflow_rank1", functools.partial(GradVac, 3), amp=True, overflow=(1, 1)),
    Case("two_micro_batches", MGDA, micro=2),
    Case("task_clip", UPGrad, clip=functools.partial(TaskClip, 0.5)),
    Case("task_auto_clip", PCGrad, clip=functools.partial(TaskAutoClip, 50.0)),
    Case("task_value_clip", UPGrad, clip=functools.partial(TaskValueClip, 0.05)),
    Case("global_clip_amp", UPGrad, global_clip=0.3, amp=True, heads_sharded=True),
    Case("update_every", UPGrad, update_every=2, steps=4),
    Case("update_every_sharded_heads", MGDA, update_every=2, steps=4, heads_sharded=True,
         micro=2),
    Case("features", MGDA, mode="features"),
    Case("features_amp", PCGrad, mode="features", amp=True),
    Case("gradnorm_weighting", Sum, weighting=gradnorm, steps=4),
    Case("graddrop", graddrop),
    Case("gathered_once_per_step", UPGrad, keep="backward", micro=2),
    Case("no_reshard_after_forward", PCGrad, keep="forward"),
    Case("dbmtl_rank_local_state", dbmtl, local_state=True),
]
RESUME = [Case("gradvac_amp", functools.partial(GradVac, 3), steps=4, amp=True),
          Case("dbmtl", dbmtl, steps=4, local_state=True),
          # the buffer's cached weights: a tensor in the checkpoint, none in a fresh buffer
          Case("update_every_amp", UPGrad, update_every=3, steps=5, amp=True)]
NAIVE = Case("naive", UPGrad)
FOUR = [Case("upgrad", UPGrad), Case("pcgrad_sharded_heads", PCGrad, heads_sharded=True)]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return spawn_bounded(functools.partial(run_all_worker, cases=CASES, resume=RESUME,
                                           with_failures=True, naive=NAIVE),
                         world=2, limit_s=240)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return spawn_bounded(functools.partial(run_all_worker, cases=FOUR, resume=[],
                                           with_failures=False), world=4, limit_s=240)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sharded_equals_single_process(two_ranks: list[dict[str, Any]], case: Case) -> None:
    reference = train(case)
    for rank in range(2):
        assert_close_runs(two_ranks[rank][case.name], reference, local_state=case.local_state)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ranks_agree_exactly(two_ranks: list[dict[str, Any]], case: Case) -> None:
    zero, one = two_ranks[0][case.name], two_ranks[1][case.name]
    assert "error" not in zero and "error" not in one
    for a, b in zip(zero["stats"], one["stats"]):
        for key, value in a.items():
            if isinstance(value, torch.Tensor):  # bit-identical, NaN where a skip has NaN
                torch.testing.assert_close(value, b[key], rtol=0, atol=0, equal_nan=True)
            else:
                assert value == b[key], key
    if not case.local_state:
        assert repr(zero["balancer"]) == repr(one["balancer"])
    assert repr(zero["clip"]) == repr(one["clip"])


def test_clippers_act_and_keep_rank_identical_state(two_ranks: list[dict[str, Any]]) -> None:
    """The clip cases clip (else they would test nothing); TaskAutoClip's history equals the
    single-process one."""
    reference = train(CASES[8])
    got = two_ranks[0]["task_auto_clip"]["clip"]
    torch.testing.assert_close(got["history"], reference["clip"]["history"],
                               rtol=1e-6, atol=1e-7)
    norms = reference["stats"][0]["task_norms"]
    assert float(norms.max()) > 0.5  # TaskClip(0.5) scales at least one row


def test_overflow_on_one_rank_skips_everywhere(two_ranks: list[dict[str, Any]]) -> None:
    for rank in range(2):
        run = two_ranks[rank]["amp_overflow_rank1"]
        assert [s["found_inf"] for s in run["stats"]] == [False, True, False]
        assert run["scale"] == 2.0**9  # lowered once, on every rank


def test_naive_per_rank_balancing_differs(two_ranks: list[dict[str, Any]]) -> None:
    """K backward passes with each rank balancing its own columns (its own Gramian): the
    ranks compute other weights than each other and than one process, and the parameters
    leave the single-process run."""
    reference = train(NAIVE)
    zero, one = two_ranks[0]["naive"], two_ranks[1]["naive"]
    assert "error" not in zero, zero.get("error")
    assert not torch.allclose(zero["weights"][0], one["weights"][0], rtol=1e-3)
    assert not torch.allclose(zero["weights"][0], reference["stats"][0]["weights"], rtol=1e-3)
    assert max(float((a - b).abs().max()) for a, b in zip(zero["params"], reference["params"])
               ) > 1e-4


@pytest.mark.parametrize("case", RESUME, ids=[c.name for c in RESUME])
def test_resume_from_distributed_checkpoint_is_bit_identical(
        two_ranks: list[dict[str, Any]], case: Case) -> None:
    for rank in range(2):
        assert_resumed_bit_identical(two_ranks[rank]["resume_" + case.name])


def test_refusals_name_the_alternative_and_move_nothing(
        two_ranks: list[dict[str, Any]]) -> None:
    failures = two_ranks[0]["failures"]
    assert "error" not in failures, failures.get("error")
    assert "error" not in two_ranks[1]["failures"], two_ranks[1]["failures"].get("error")
    assert failures["gramian"].startswith("ValueError") and "mode='matrix'" in failures["gramian"]
    assert failures["auto"].startswith("ValueError") and "mode='matrix'" in failures["auto"]
    assert failures["batched"].startswith("ValueError") and "'loop'" in failures["batched"]
    assert failures["mixed"].startswith("ValueError") and "fully_shard" in failures["mixed"]
    assert failures["not_shardable"].startswith("TypeError")
    assert "NotShardable" in failures["not_shardable"]
    assert all(failures["trunk_grad_after_refusal"])
    assert failures["heads_unchanged"]
    assert failures["sync_off"].startswith("RuntimeError")
    assert "set_requires_gradient_sync" in failures["sync_off"]


def test_each_rank_keeps_only_its_columns(two_ranks: list[dict[str, Any]]) -> None:
    """[K, P_r] per rank, the P_r adding up to P: the buffer's memory falls with the ranks."""
    shapes = [two_ranks[r]["failures"]["matrix_shape"] for r in range(2)]
    total = two_ranks[0]["failures"]["trunk_numel"]
    assert [s[0] for s in shapes] == [3, 3]
    assert sum(s[1] for s in shapes) == total
    assert all(s[1] < total for s in shapes)


@pytest.mark.parametrize("case", FOUR, ids=[c.name for c in FOUR])
def test_four_ranks_equal_single_process(four_ranks: list[dict[str, Any]], case: Case) -> None:
    reference = train(case)
    for rank in range(4):
        assert_close_runs(four_ranks[rank][case.name], reference)
