"""Data parallel on two gloo processes: every rank equals one process on the full batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ddp import Scenario, run, spawn_runs

# emanorm: a stateful, random stand-in written in the tests (support.ddp.EmaNormBalancer)
# gradnorm: a loss weighting (GradNorm's own state: weights, L(0), Adam on w)
BALANCERS = ["sum", "constant", "emanorm", "pcgrad", "mgda", "mgda-loss", "gradvac",
             "gradnorm"]

SCENARIOS = [
    *(Scenario(balancer=b) for b in BALANCERS),
    *(Scenario(balancer=b, ddp=True) for b in BALANCERS),
    *(Scenario(balancer=b, micro=2) for b in BALANCERS),
    *(Scenario(balancer=b, ddp=True, micro=2) for b in BALANCERS),
    Scenario(balancer="emanorm", ddp=True, micro=2, update_every=2, steps=5),
    Scenario(balancer="emanorm", amp=True, inf_step=2),
    Scenario(balancer="emanorm", ddp=True, amp=True, inf_step=1, micro=2),
    Scenario(balancer="gradnorm", ddp=True, amp=True, inf_step=1, micro=2),
    Scenario(balancer="sum", ddp=True, naive=True),
    # features mode: the ranks gather the feature gradients and sum the trunk's gradients
    *(Scenario(balancer=b, mode="features") for b in ("sum", "pcgrad", "mgda-loss", "emanorm")),
    Scenario(balancer="emanorm", mode="features", amp=True, inf_step=2),
    # gramian mode: the ranks gather the linear layers' inputs and output gradients
    *(Scenario(balancer=b, mode="gramian", ddp=True, micro=2)
      for b in ("sum", "pcgrad", "mgda-loss", "emanorm")),
    Scenario(balancer="emanorm", mode="gramian", amp=True, inf_step=2),
    # per-sample clipping (ghost norms) and DP noise: the step itself is unchanged
    *(Scenario(balancer=b, per_sample=True) for b in ("sum", "mgda")),
    Scenario(balancer="pcgrad", per_sample=True, ddp=True, micro=2),
]


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return spawn_runs(SCENARIOS)


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, dict):
        return [t for key in sorted(state) for t in _tensors(state[key])]
    if isinstance(state, (list, tuple)):
        return [t for item in state for t in _tensors(item)]
    return [state] if isinstance(state, torch.Tensor) else []


def _assert_identical(a: Any, b: Any) -> None:
    ta, tb = _tensors(a), _tensors(b)
    assert len(ta) == len(tb) > 0
    for x, y in zip(ta, tb):
        assert torch.equal(x, y)


@pytest.mark.parametrize("sc", [s for s in SCENARIOS if not s.naive], ids=lambda s: s.key)
def test_ranks_identical_and_equal_full_batch(ranks: list[dict[str, Any]], sc: Scenario) -> None:
    r0, r1 = ranks[0][sc.key], ranks[1][sc.key]
    _assert_identical(r0["params"], r1["params"])
    assert r0["state"].get("_type") == r1["state"].get("_type")
    if _tensors(r0["state"]):  # stateless balancers hold only their "_type" tag
        _assert_identical(r0["state"], r1["state"])
    assert r0["found_inf"] == r1["found_inf"]
    reference = run(sc)  # one process, the concatenated batch
    assert r0["found_inf"] == reference["found_inf"]
    for p, q in zip(r0["params"], reference["params"]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    for a, b in zip(r0["losses"], reference["losses"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, equal_nan=True)
    for a, b in zip(_tensors(r0["state"]), _tensors(reference["state"])):
        if a.is_floating_point():
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(a, b)
    # the run really trained (parameters moved away from the start)
    start = run(Scenario(balancer=sc.balancer, steps=0))["params"]
    assert max((p - s).abs().max().item() for p, s in zip(r0["params"], start)) > 1e-3


def test_amp_skip_agrees_when_one_rank_overflows(ranks: list[dict[str, Any]]) -> None:
    for sc in (s for s in SCENARIOS if s.amp):
        r0, r1 = ranks[0][sc.key], ranks[1][sc.key]
        # only rank 1 saw the inf, yet both ranks skipped exactly that step
        expected = [step == sc.inf_step for step in range(sc.steps)]
        assert r0["found_inf"] == r1["found_inf"] == expected
        assert r0["scale"] == r1["scale"] == 2.0**10 / 2  # halved once by the skip


def test_naive_backward_per_task_under_ddp_diverges(ranks: list[dict[str, Any]]) -> None:
    """K loss.backward(retain_graph=True) under DDP: only task 0 is averaged over ranks."""
    sc = next(s for s in SCENARIOS if s.naive)
    r0, r1 = ranks[0][sc.key], ranks[1][sc.key]
    gap = max((a - b).abs().max().item() for a, b in zip(r0["params"], r1["params"]))
    assert gap > 1e-3  # the ranks silently drifted apart
    reference = run(Scenario(balancer=sc.balancer))
    off = max((a - b).abs().max().item() for a, b in zip(r0["params"], reference["params"]))
    assert off > 1e-3
    ours = ranks[0][Scenario(balancer=sc.balancer, ddp=True).key]
    for p, q in zip(ours["params"], reference["params"]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_helpers_detect_and_align_ranks(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["probe"]["differing_detected"] and ranks[1]["probe"]["differing_detected"]
    # both generators now hold rank 0's state: the draws equal a fresh seed-0 generator's
    expected = torch.rand(4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ranks[0]["probe"]["draw"], expected)
    assert torch.equal(ranks[1]["probe"]["draw"], expected)


def test_forgetting_no_sync_under_ddp_gives_the_same_steps(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["forgot_no_sync_same"] and ranks[1]["forgot_no_sync_same"]


@pytest.mark.parametrize("balancer", ["pcgrad", "mgda-loss", "emanorm"])
def test_gramian_mode_over_ranks_equals_matrix_mode(ranks: list[dict[str, Any]],
                                                   balancer: str) -> None:
    # matrix mode reduces the [K, P] rows; gramian mode gathers layer operands instead
    gramian = ranks[0][Scenario(balancer=balancer, mode="gramian", ddp=True, micro=2).key]
    matrix = ranks[0][Scenario(balancer=balancer, ddp=True, micro=2).key]
    for p, q in zip(gramian["params"], matrix["params"]):
        torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
