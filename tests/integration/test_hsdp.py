"""The balanced step on a trunk under HSDP: ``fully_shard`` over a 2 × 2 ``(replicate,
shard)`` mesh of 4 gloo ranks.

Every run must give the single-process full-batch run's parameters, statistics and balancer
state (to 1e-6 relative, float32) on every rank (docs/distributed.md, "HSDP").
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

from gradbalance.balancers import MGDA, GradVac, NashMTL, PCGrad, Sum, UPGrad
from gradbalance.clip import TaskAutoClip, TaskClip, TaskValueClip
from support.ddp import spawn_bounded
from support.fsdp import Case, assert_close_runs, assert_resumed_bit_identical, gradnorm, train
from support.hsdp import MESH, run_worker

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is unavailable")

CASES = [
    Case("pcgrad", PCGrad, mesh=MESH),
    Case("mgda_sharded_heads", MGDA, mesh=MESH, heads_sharded=True),
    Case("upgrad", UPGrad, mesh=MESH),
    Case("nash_mtl", functools.partial(NashMTL, 3), mesh=MESH),
    Case("gradvac", functools.partial(GradVac, 3), mesh=MESH),
    Case("gradnorm_weighting", Sum, weighting=gradnorm, steps=4, mesh=MESH),
    # rank 2 is in the other replica and shard group than rank 0: its overflow must reach all
    Case("amp_overflow_rank2", functools.partial(GradVac, 3), amp=True, overflow=(1, 2),
         mesh=MESH),
    Case("two_micro_batches", MGDA, micro=2, mesh=MESH),
    Case("task_clip", UPGrad, clip=functools.partial(TaskClip, 0.5), mesh=MESH),
    Case("task_auto_clip", PCGrad, clip=functools.partial(TaskAutoClip, 50.0), mesh=MESH),
    Case("task_value_clip", UPGrad, clip=functools.partial(TaskValueClip, 0.05), mesh=MESH),
    Case("features", MGDA, mode="features", mesh=MESH),
    Case("update_every_sharded_heads", MGDA, update_every=2, steps=4, heads_sharded=True,
         micro=2, mesh=MESH),
    Case("gathered_once_per_step", UPGrad, keep="backward", micro=2, mesh=MESH),
]
RESUME = [Case("upgrad_amp", UPGrad, steps=4, amp=True, mesh=MESH, update_every=2)]
# Each replica's 1-D "shard" submesh as an independent 2-rank job, the buffer on its group
SUBMESH = [Case("submesh_upgrad", UPGrad, mesh=MESH, submesh=True),
           Case("submesh_pcgrad_amp_overflow", PCGrad, amp=True, overflow=(1, 1), mesh=MESH,
                submesh=True)]
WORLD = MESH[0] * MESH[1]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return spawn_bounded(functools.partial(run_worker, cases=CASES, resume=RESUME,
                                           submesh=SUBMESH),
                         world=WORLD, limit_s=540)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hsdp_equals_single_process(four_ranks: list[dict[str, Any]], case: Case) -> None:
    reference = train(case)
    for rank in range(WORLD):
        assert_close_runs(four_ranks[rank][case.name], reference)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_ranks_agree_exactly(four_ranks: list[dict[str, Any]], case: Case) -> None:
    zero = four_ranks[0][case.name]
    for rank in range(1, WORLD):
        other = four_ranks[rank][case.name]
        assert "error" not in other, other.get("error")
        for a, b in zip(zero["params"], other["params"]):
            assert torch.equal(a, b)
        for a, b in zip(zero["stats"], other["stats"]):
            for key, value in a.items():
                if isinstance(value, torch.Tensor):
                    torch.testing.assert_close(value, b[key], rtol=0, atol=0, equal_nan=True)
                else:
                    assert value == b[key], key


@pytest.mark.parametrize("case", SUBMESH, ids=[c.name for c in SUBMESH])
def test_submesh_over_a_subgroup_equals_single_process(four_ranks: list[dict[str, Any]],
                                                        case: Case) -> None:
    """Each replica's pair of ranks trains alone on the whole batch (its sub-rank's share)."""
    reference = train(case)
    for rank in range(WORLD):
        assert_close_runs(four_ranks[rank][case.name], reference)


def test_overflow_on_one_rank_skips_everywhere(four_ranks: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        run = four_ranks[rank]["amp_overflow_rank2"]
        assert [s["found_inf"] for s in run["stats"]] == [False, True, False]
        assert run["scale"] == 2.0**9  # lowered once, on every rank


def test_clip_acts() -> None:
    """TaskClip(0.5) scales at least one row of the reference (else the case tests nothing):
    the first step's rows, unclipped, are longer than 0.5."""
    unclipped = train(dataclasses.replace(CASES[8], clip=None))
    assert float(unclipped["stats"][0]["task_norms"].max()) > 0.5


@pytest.mark.parametrize("case", RESUME, ids=[c.name for c in RESUME])
def test_resume_from_distributed_checkpoint_is_bit_identical(
        four_ranks: list[dict[str, Any]], case: Case) -> None:
    for rank in range(WORLD):
        assert_resumed_bit_identical(four_ranks[rank]["resume_" + case.name])


def test_other_placements_are_refused_naming_what_is_supported(
        four_ranks: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        found = four_ranks[rank]["refusals"]
        assert "error" not in found, found.get("error")
        for name in ("replicated", "tensor_parallel", "three_dims"):
            assert found[name].startswith("ValueError"), (name, found[name])
            assert "(Replicate(), Shard(0)) on a 2-D mesh" in found[name], found[name]
            assert "Shard(0) on a 1-D mesh" in found[name]
        assert "3-D mesh" in found["three_dims"]
        assert found["two_meshes"].startswith("ValueError")
        assert "same mesh=" in found["two_meshes"]


def test_buffer_group_other_than_the_mesh_is_refused(four_ranks: list[dict[str, Any]]) -> None:
    for rank in range(WORLD):
        found = four_ranks[rank]["group_mismatch"]
        assert "error" not in found, found.get("error")
        pair = [0, 1] if rank < 2 else [2, 3]
        world = found["world_over_submesh"]
        assert world.startswith("ValueError"), world
        assert f"ranks [0, 1, 2, 3] but the trunk is sharded over a mesh of ranks {pair}" in world
        assert "mesh.get_group()" in world
        local = found["local_over_mesh"]
        assert local.startswith("ValueError") and "process_group='local'" in local, local
        assert found["submesh_group"] == "no error"
