"""Loss weightings that read the losses' values (GLS, ScaleInvariant, STCH, FAMO) under data
parallelism, on two gloo processes: with ``global_losses`` (and in the integrations' core,
which applies it) the ranks' averaged gradient is one process's on the global batch; with
each rank's own losses it is not, and the weighting warns once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ddp import spawn_bounded
from support.ddp_weighting import WEIGHTINGS, weighting_worker


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn_bounded(weighting_worker, limit_s=120)


def _off(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(float((g - r).abs().max() / r.abs().max()) for g, r in zip(grads, reference))


@pytest.mark.parametrize("key", list(WEIGHTINGS))
def test_global_losses_give_the_single_process_gradient(ranks: list[dict[str, Any]],
                                                         key: str) -> None:
    for rank in ranks:
        case = rank[key]
        assert _off(case["global"], case["single"]) < 1e-12
        assert case["global_warned"] == []
        if key != "famo":  # the integrations refuse FAMO (tests/unit/test_integrations_core.py)
            assert _off(case["parts"], case["single"]) < 1e-12
            assert case["parts_warned"] == []
        # each rank's own losses: another step (the case the helper exists for)
        assert _off(case["own"], case["single"]) > 1e-3


def test_own_losses_warn_once_per_class(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert len(rank["gls"]["own_warned"]) == 1
        assert "global_losses" in rank["gls"]["own_warned"][0]
        assert rank["stch_nadir"]["own_warned"] == []  # STCH warned once already


def test_ranks_with_other_task_counts_raise(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["mismatch"]["type"] == "RankAgreementError"
        assert "global_losses" in rank["mismatch"]["text"]
        assert "passes 1 tensor(s) (3 values)" in rank["mismatch"]["text"]
