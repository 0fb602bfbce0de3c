"""Task names in the logged tags: ``log_stats``, ``stats_to_dict``, ``CSVLogger`` and the
integrations' scalars (``loss/<name>``), and the checks of the names."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch import nn

import gradbalance as gb
from gradbalance.integrations._core import stats_scalars
from gradbalance.monitor import task_labels


class Writer:
    def __init__(self) -> None:
        self.scalars: dict[str, float] = {}

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[tag] = value


def _stats() -> gb.StepStats:
    trunk = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        trunk.weight.copy_(torch.tensor([[1.0, 0.0]]))
    x = torch.eye(2)
    # L0 = w·e0 = 1, L1 = 3 w·e1 = 0: task gradients e0 and 3 e1 (norms 1 and 3, cosine 0)
    losses = [trunk(x[0]).sum(), 3 * trunk(x[1]).sum()]
    return gb.balanced_backward(losses, gb.balancers.Sum(), shared_params=trunk.parameters())


def test_named_tags() -> None:
    writer = Writer()
    gb.log_stats(writer, _stats(), 0, task_names=["depth", "normals"])
    s = writer.scalars
    assert (s["loss/depth"], s["loss/normals"]) == (1.0, 0.0)
    assert s["size/depth"] == pytest.approx(1.0) and s["size/normals"] == pytest.approx(3.0)
    assert s["cos/depth_normals"] == pytest.approx(0.0, abs=1e-12)
    assert not any("task0" in tag or "task1" in tag for tag in s)
    # the default names are unchanged
    assert "loss/task1" in gb.stats_to_dict(_stats()) and "cos/task0_task1" in gb.stats_to_dict(
        _stats())


def test_csv_logger_columns(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    with gb.CSVLogger(path, task_names=["a", "b"]) as logger:
        logger.log_stats(_stats(), 0)
        logger.log_stats(_stats(), 1, task_names=["a", "b"])
    with path.open() as f:
        header = next(csv.reader(f))
    assert header[:5] == ["step", "loss/a", "size/a", "loss/b", "size/b"]
    assert "cos/a_b" in header


def test_integration_scalars_are_named() -> None:
    scalars = stats_scalars(_stats(), ["depth", "normals"])
    assert {"loss/depth", "size/normals", "cos/depth_normals"} <= set(scalars)
    assert "loss/task0" in stats_scalars(_stats())


@pytest.mark.parametrize(("names", "error", "text"), [
    (["a"], ValueError, "Invalid task_names: ['a'] (expected 2 distinct"),
    (["a", "a"], ValueError, "Invalid task_names: ['a', 'a']"),
    (["a", "b/c"], ValueError, "bad: ['b/c']"),
    (["a", ""], ValueError, "bad: ['']"),
    ("ab", TypeError, "Invalid task_names: the string 'ab'"),
])
def test_bad_names_are_refused(names: object, error: type[Exception], text: str,
                               tmp_path: Path) -> None:
    with pytest.raises(error) as info:
        task_labels(names, 2)  # type: ignore[arg-type]
    assert text in str(info.value)
    with pytest.raises(error):
        gb.log_stats(Writer(), _stats(), 0, task_names=names)  # type: ignore[arg-type]
    if isinstance(names, str) or len(set(names)) != len(names) or "" in names:
        with pytest.raises(error):
            gb.CSVLogger(tmp_path / "x.csv", task_names=names)  # type: ignore[arg-type]
        assert not (tmp_path / "x.csv").exists()  # refused before the file is created


def test_get_weighting_names_a_missing_argument() -> None:
    with pytest.raises(TypeError) as info:
        gb.get_weighting("gradnorm", num_tasks=2)
    assert str(info.value) == (
        "loss weighting 'gradnorm' (GradNorm) needs layer: pass layer=... too, e.g. "
        "get_weighting('gradnorm', num_tasks=..., layer=...); see GradNorm's docstring")
    trunk = nn.Linear(3, 3)
    assert gb.get_weighting("gradnorm", num_tasks=2, layer=trunk).num_tasks == 2
    for name in gb.WEIGHTINGS:  # the README's form works for every other weighting
        if name != "gradnorm":
            assert gb.get_weighting(name, num_tasks=3).num_tasks == 3
