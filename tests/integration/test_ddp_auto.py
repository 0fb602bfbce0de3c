"""``mode="auto"`` on two gloo ranks: the full-batch update, and one route on every rank;
``mode="gramian"`` with ranks on different layer routes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from support.ddp import spawn_bounded
from support.ddp_auto import train, train_gramian, worker


@pytest.fixture(scope="module")
def ranks() -> list[dict[Any, Any]]:
    return spawn_bounded(worker, world=2, limit_s=120.0)


@pytest.mark.parametrize("width", [16, 64])
def test_auto_over_ranks_equals_one_process_on_the_full_batch(ranks: list[dict[Any, Any]],
                                                              width: int) -> None:
    reference = train(width)  # one process, the whole batch
    for rank in ranks:
        for p, q in zip(rank[width]["params"], reference["params"]):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("width", [16, 64])
def test_both_ranks_take_the_same_routes(ranks: list[dict[Any, Any]], width: int) -> None:
    first, second = (rank[width] for rank in ranks)
    assert first["routes"] == second["routes"]
    assert first["layers"] == second["layers"]
    # step 1: the balancer is not known yet; then the model alone decides under
    # torch.distributed: 4 rows per micro-batch, two micro-batches, K = 3, float64 (predicted
    # gramian / matrix 0.59 at width 16, 0.19 at width 64: gramian)
    assert first["routes"] == ["matrix", "gramian", "gramian", "gramian"]
    assert first["layers"][0] is None and all(layers for layers in first["layers"][1:])


def test_ranks_with_different_shapes_raise_before_anything_moves(
        ranks: list[dict[Any, Any]]) -> None:
    for rank in ranks:
        assert "mode='auto': the ranks took different routes" in rank["unequal"]
        assert "rank 0: gramian, rank 1: matrix" in rank["unequal"]
        assert rank["unequal"].endswith("grads moved: False")  # heads included


def test_gramian_ranks_with_different_layer_routes_agree_on_the_rows(
        ranks: list[dict[Any, Any]]) -> None:
    # rank 0 forces the rows, rank 1 the activations: every layer moves to rows on rank 1
    # (exactly), and both equal one process on the full batch (on either route)
    for force in ("rows", "activations"):
        reference = train_gramian(force)
        for rank in ranks:
            for p, q in zip(rank["mixed"]["params"], reference["params"]):
                torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-12)
    assert all(set(layers.values()) == {"rows"}
               for rank in ranks for layers in rank["mixed"]["layers"])
