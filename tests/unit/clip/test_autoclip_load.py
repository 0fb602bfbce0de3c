"""A percentile clipper's loaded history is checked before anything changes: finite norms, as
many per step as it tracks, a count and position that agree (docs/loop.md, "Checkpoints")."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradbalance.clip import TaskAutoClip
from support.declared_state import poisoned, resized
from support.loop_state import assert_same_state


def _used(k: int, steps: int, seed: int) -> TaskAutoClip:
    clipper = TaskAutoClip(percentile=50, history_size=4)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        clipper(torch.randn(k, 5, generator=gen, dtype=torch.float64))
    return clipper


def _damaged(state: dict[str, Any], seed: int) -> dict[str, dict[str, Any]]:
    h, t = state["history"], state["threshold"]
    return {
        "history nan": {**state, "history": poisoned(h, float("nan"), seed)},
        "history inf": {**state, "history": poisoned(h, float("inf"), seed)},
        "threshold nan": {**state, "threshold": poisoned(t, float("nan"), seed)},
        "history of a task more": {**state, "history": resized(h, 1, 1)},
        "history of a task fewer": {**state, "history": resized(h, 1, -1)},
        "threshold of a task more": {**state, "threshold": resized(t, 0, 1)},
        "history of another size": {**state, "history": resized(h, 0, 1)},
        "negative count": {**state, "count": -1},
        "position off": {**state, "position": (state["position"] + 1) % 4},
        "count without history": {**state, "history": None},
        "history not a tensor": {**state, "history": h.tolist()},
        "integer threshold": {**state, "threshold": t.long()},
    }


@pytest.mark.parametrize(("k", "steps", "seed"), [(2, 3, 0), (3, 6, 1), (5, 9, 2)])
def test_damaged_history_is_refused_and_nothing_moves(k: int, steps: int, seed: int) -> None:
    clipper, twin = _used(k, steps, seed), _used(k, steps, seed)
    before = clipper.state_dict()
    for label, state in _damaged(before, seed).items():
        with pytest.raises(ValueError, match="state_dict"):
            clipper.load_state_dict(state)
        assert_same_state(clipper.state_dict(), before, label)
    g = torch.randn(k, 5, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    a, b = g.clone(), g.clone()
    assert torch.equal(clipper(a), twin(b)) and torch.equal(a, b)


def test_a_history_of_another_task_count_loads_into_a_fresh_clipper() -> None:
    """A fresh clipper tracks no tasks yet: any consistent history loads."""
    saved = _used(4, 5, 0).state_dict()
    fresh = TaskAutoClip(percentile=50, history_size=4)
    fresh.load_state_dict(saved)
    assert_same_state(fresh.state_dict(), saved)
