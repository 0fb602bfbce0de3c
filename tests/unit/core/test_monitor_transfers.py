"""stats_to_dict reads a step's tensors in one host transfer and logs the hand-derived tags."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradbalance import stats_to_dict
from gradbalance.stats import StepStats

#: The Tensor methods that read values to the host.
_READS = ("tolist", "item", "cpu", "numpy", "__float__", "__bool__", "__int__", "__index__")


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for name in _READS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _n: str = name, _f: Any = original,
                    **kwargs: Any) -> Any:
            calls.append(_n)
            return _f(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


def _full_stats() -> StepStats:
    cosine = torch.tensor([[1.0, 0.5, -0.25], [0.5, 1.0, 0.0], [-0.25, 0.0, 1.0]])
    return StepStats(
        losses=torch.tensor([1.5, 2.0, 0.25]), task_norms=torch.tensor([3.0, 4.0, 5.0]),
        cosine=cosine, cosine_to_update=None, update_norm=None,
        weights=torch.tensor([0.5, 0.25, 0.25]), found_inf=True,
        loss_scale_tensor=torch.tensor(1024.0), pre_clip_norms=torch.tensor([6.0, 7.0, 8.0]),
        route="gramian",
    )


def test_one_read_for_every_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = _full_stats()
    calls = _count_reads(monkeypatch)
    out = stats_to_dict(stats, pre_clip=torch.tensor(9.0))
    assert len(calls) == 1, calls
    assert out == {
        "loss/task0": 1.5, "size/task0": 3.0, "loss/task1": 2.0, "size/task1": 4.0,
        "loss/task2": 0.25, "size/task2": 5.0,
        "w/task0": 0.5, "w/task1": 0.25, "w/task2": 0.25,
        "cos/task0_task1": 0.5, "cos/task0_task2": -0.25, "cos/task1_task2": 0.0,
        "pre_clip/task0": 6.0, "pre_clip/task1": 7.0, "pre_clip/task2": 8.0,
        "pre_clip": 9.0, "amp_skipped": 1.0, "route/gramian": 1.0,
    }
    assert list(out)[:6] == ["loss/task0", "size/task0", "loss/task1", "size/task1",
                             "loss/task2", "size/task2"]


def test_reused_weights_step_logs_losses_and_weights_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    stats = StepStats(losses=torch.tensor([1.0, 2.0]), task_norms=None, cosine=None,
                      cosine_to_update=None, update_norm=None, route="matrix")
    calls = _count_reads(monkeypatch)
    out = stats_to_dict(stats, pre_clip=0.5, weights=torch.tensor([2.0, 3.0]))
    assert len(calls) == 1, calls
    assert out == {"loss/task0": 1.0, "loss/task1": 2.0, "w/task0": 2.0, "w/task1": 3.0,
                   "pre_clip": 0.5, "amp_skipped": 0.0, "route/gramian": 0.0}


def test_wrong_weights_raise_before_any_read(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = _full_stats()
    calls = _count_reads(monkeypatch)
    with pytest.raises(ValueError, match="weights has 2 entries but the step has 3 tasks"):
        stats_to_dict(stats, weights=torch.tensor([1.0, 2.0]))
    assert calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_transfer_from_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    stats = _full_stats()
    for field in ("losses", "task_norms", "cosine", "weights", "pre_clip_norms"):
        setattr(stats, field, getattr(stats, field).cuda())
    calls = _count_reads(monkeypatch)
    out = stats_to_dict(stats, pre_clip=torch.tensor(9.0, device="cuda"))
    assert len(calls) == 1, calls
    assert out["cos/task0_task2"] == -0.25 and out["pre_clip"] == 9.0
