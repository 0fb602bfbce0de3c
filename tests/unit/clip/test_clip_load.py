"""Every clipper's ``load_state_dict`` checks the whole state before anything changes: a state
of the wrong number of tasks, the wrong shape or holding NaN raises ``ValueError`` and leaves
the clipper as it was, so its next call equals that of an untouched twin."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from gradbalance.clip import AGC, AutoClip, PerSampleClip, TaskAutoClip, TaskClip, TaskValueClip
from support.loop_state import assert_same_state


def _refused(clipper: Any, bad: dict[str, Any], label: str) -> None:
    """Loading ``bad`` raises ``ValueError`` naming the state and changes nothing."""
    before = clipper.state_dict()
    with pytest.raises(ValueError, match="state_dict"):
        clipper.load_state_dict(bad)
    assert_same_state(clipper.state_dict(), before, label)


@pytest.mark.parametrize("make", [lambda: TaskClip(1.0), lambda: TaskValueClip(0.5),
                                  lambda: AGC(0.01)])
def test_a_stateless_clipper_takes_only_the_empty_state(make: Callable[[], Any]) -> None:
    clipper = make()
    clipper.load_state_dict({})
    for label, bad in {"a key": {"history": torch.zeros(3, 1)}, "NaN": {"x": math.nan},
                       "not a dict": None, "a list": [torch.zeros(2)]}.items():
        with pytest.raises(ValueError, match="state_dict"):
            clipper.load_state_dict(bad)  # type: ignore[arg-type]
        assert clipper.state_dict() == {} and repr(clipper) == repr(make()), label


def _auto_steps(clipper: AutoClip | TaskAutoClip, k: int, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    for _ in range(steps):
        g = torch.randn(k, 6, generator=gen, dtype=torch.float64)
        if isinstance(clipper, TaskAutoClip):
            clipper(g)
        else:
            w.grad = g[0].clone()
            clipper([w])


def _bad_auto_states(state: dict[str, Any], k: int) -> dict[str, dict[str, Any]]:
    h, t = state["history"], state["threshold"]
    return {
        "a task more": {**state, "history": torch.cat([h, h[:, :1]], 1),
                        "threshold": torch.cat([t, t[:1]])},
        "threshold of another shape": {**state, "threshold": t.reshape(k, 1)},
        "threshold of a task fewer": {**state, "threshold": t[1:]},
        "history of another size": {**state, "history": torch.cat([h, h[:1]])},
        "history without threshold": {**state, "threshold": None},
        "threshold without history": {**state, "history": None, "count": 0, "position": 0},
        "NaN history": {**state, "history": h.clone().fill_(math.nan)},
        "NaN threshold": {**state, "threshold": torch.full_like(t, math.nan)},
        "inf threshold": {**state, "threshold": torch.full_like(t, math.inf)},
    }


@pytest.mark.parametrize(("cls", "k"), [(AutoClip, 1), (TaskAutoClip, 2), (TaskAutoClip, 5)])
@pytest.mark.parametrize(("steps", "seed"), [(2, 0), (7, 1)])
def test_a_bad_auto_clip_state_is_refused_and_nothing_moves(cls: type, k: int, steps: int,
                                                            seed: int) -> None:
    clipper, twin = cls(percentile=40, history_size=4), cls(percentile=40, history_size=4)
    _auto_steps(clipper, k, steps, seed)
    _auto_steps(twin, k, steps, seed)
    for label, bad in _bad_auto_states(clipper.state_dict(), k).items():
        _refused(clipper, bad, label)
    _auto_steps(clipper, k, 3, seed + 10)
    _auto_steps(twin, k, 3, seed + 10)
    assert_same_state(clipper.state_dict(), twin.state_dict())


@pytest.mark.parametrize("columns", [2, 3])
def test_autoclip_refuses_a_history_of_several_norms_per_step_even_when_fresh(
        columns: int) -> None:
    """AutoClip clips one total norm: a history of ``columns`` norms per step would fail at
    the next call, so even a fresh clipper (which tracks nothing yet) refuses it."""
    saved = TaskAutoClip(history_size=4)
    _auto_steps(saved, columns, 3, 0)
    state = {**saved.state_dict(), "_type": "AutoClip"}
    _refused(AutoClip(history_size=4), state, f"{columns} norms per step")


def _per_sample_noise(clip: PerSampleClip) -> torch.Tensor:
    p = torch.zeros(5, requires_grad=True)
    p.grad = torch.zeros(5)
    clip.add_noise_([p], batch_size=2)
    return p.grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_bad_per_sample_clip_state_is_refused_and_the_generator_kept(seed: int) -> None:
    clip, twin = (PerSampleClip(1.0, noise_multiplier=1.0,
                                generator=torch.Generator().manual_seed(seed)) for _ in range(2))
    _per_sample_noise(clip)
    _per_sample_noise(twin)
    good = clip.state_dict()["generator"]
    for label, bad in {
        "no generator": {},
        "not a tensor": {"generator": good.tolist()},
        "floating": {"generator": good.double()},
        "too short": {"generator": good[:-16]},  # 5,048 bytes is the legacy size torch 2.6 takes
        "too long": {"generator": torch.cat([good, good[:8]])},
        "not an mt19937 state": {"generator": torch.zeros_like(good)},
        "not a dict": [good],
    }.items():
        _refused(clip, bad, label)  # type: ignore[arg-type]
    assert torch.equal(_per_sample_noise(clip), _per_sample_noise(twin))
