"""Checkpoints and logs at their edges: an in-memory snapshot restored twice, a disabled
GradScaler, a resumed CSV log, a first row with NaN, a copied buffer."""

from __future__ import annotations

import copy
import csv
import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradbalance as gb
from gradbalance import StepStats
from gradbalance.balancers import UPGrad
from gradbalance.checkpoint import CheckpointError


def test_a_snapshot_restored_twice_gives_the_same_optimizer_state() -> None:
    """Adam kept the snapshot's tensors: training on changed the snapshot, and a second
    restore loaded the later moments."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()

    step()
    snapshot = gb.capture_state(rng=False, model=model, opt=opt)
    saved = copy.deepcopy(opt.state_dict()["state"])
    for _ in range(2):
        gb.restore_state(snapshot, model=model, opt=opt)
        assert all(torch.equal(opt.state_dict()["state"][0][k], saved[0][k]) for k in saved[0])
        step()
        step()


def test_a_disabled_grad_scaler_is_refused_not_left_unloaded() -> None:
    """``GradScaler()`` is CUDA's, disabled on a CPU machine: its load returned without
    loading, and ``load_checkpoint`` reported success."""
    buffer = io.BytesIO()
    gb.save_checkpoint(buffer, scaler=torch.amp.GradScaler("cpu", init_scale=2.0**10))
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    buffer.seek(0)
    with pytest.raises(CheckpointError, match="GradScaler given is disabled"):
        gb.load_checkpoint(buffer, scaler=disabled)
    enabled = torch.amp.GradScaler("cpu")
    assert enabled.is_enabled()
    buffer.seek(0)
    gb.load_checkpoint(buffer, scaler=enabled)
    assert enabled.get_scale() == 2.0**10


def test_a_resumed_run_appends_to_its_csv_log(tmp_path: Path) -> None:
    path = tmp_path / "run.csv"
    with gb.CSVLogger(path) as log:
        for step in range(3):
            log.log({"loss": 1.0 / (step + 1)}, step)
    with gb.CSVLogger(path, append=True) as log:
        log.log({"loss": torch.tensor(0.25)}, 3)
    rows = list(csv.reader(path.open()))
    assert rows[0] == ["step", "loss"] and [r[0] for r in rows[1:]] == ["0", "1", "2", "3"]
    assert float(rows[-1][1]) == 0.25
    with gb.CSVLogger(path) as log:  # a new logger replaces the file, as documented
        log.log({"loss": 1.0}, 0)
    assert len(list(csv.reader(path.open()))) == 2
    other = tmp_path / "other.csv"
    other.write_text("epoch,loss\n0,1.0\n")
    with pytest.raises(ValueError, match="is not a CSVLogger log"):
        gb.CSVLogger(other, append=True)


def test_a_nan_in_the_first_row_keeps_the_columns_and_a_refused_row_moves_nothing(
        tmp_path: Path) -> None:
    log, running = gb.CSVLogger(tmp_path / "nan.csv"), gb.RunningStats(window=10)
    first = StepStats(torch.tensor([0.5, math.nan]), None, None, None, None)
    second = StepStats(torch.tensor([0.4, 0.7]), None, None, None, None)
    row = gb.log_stats(log, first, 0, running=running)
    assert math.isnan(row["std/loss/task1"])
    gb.log_stats(log, second, 1, running=running)  # raised: a new std column
    before = running.state_dict()
    with pytest.raises(ValueError, match="were not in the first row"):
        log.log({"new_tag": 1.0}, 2)
    with pytest.raises(ValueError):
        gb.log_stats(log, second, -1, running=running)
    assert running.state_dict() == before
    log.close()


@pytest.mark.parametrize(("scalars", "step", "text"), [
    ([("loss", 1.0)], 0, "Invalid scalars: a list"),
    ({"name": "hello"}, 0, r"Invalid scalars\['name'\]"),
    ({"loss": 1.0}, -1, "Invalid step: -1"),
    ({"loss": 1.0}, "x", "Invalid step: 'x'"),
    ({}, 0, "the first row is empty"),
    ({"step": 1.0}, 0, "the tag 'step'"),
])
def test_csv_logger_checks_a_row_before_writing(tmp_path: Path, scalars: Any, step: Any,
                                               text: str) -> None:
    path = tmp_path / "v.csv"
    with gb.CSVLogger(path) as log, pytest.raises(ValueError, match=text):
        log.log(scalars, step)
    assert path.read_text() == ""


@pytest.mark.parametrize("version", [True, -3, 0, 2])
def test_a_checkpoint_format_this_version_does_not_write_is_refused(tmp_path: Path,
                                                                   version: Any) -> None:
    path = tmp_path / "x.pt"
    torch.save({"format": version, "objects": {"model": nn.Linear(4, 2).state_dict()}}, path)
    with pytest.raises(CheckpointError, match="has format"):
        gb.load_checkpoint(path, model=nn.Linear(4, 2))


def test_a_copied_buffer_takes_its_copied_balancer() -> None:
    """The copy's cached weights pointed at the original balancer: a reuse step refused the
    copied one."""
    torch.manual_seed(0)
    trunk, heads = nn.Linear(4, 3), nn.ModuleList([nn.Linear(3, 1) for _ in range(2)])
    buf = gb.TaskGradBuffer(trunk.parameters(), heads.parameters(), update_every=2)
    bal = UPGrad()
    x = torch.randn(8, 4)
    features = trunk(x)
    buf.backward(torch.stack([h(features).pow(2).mean() for h in heads]))
    buf.apply_(bal)
    buf2, bal2, trunk2, heads2 = copy.deepcopy((buf, bal, trunk, heads))
    features2 = trunk2(x)
    buf2.backward(torch.stack([h(features2).pow(2).mean() for h in heads2]))
    stats = buf2.apply_(bal2)  # a step that reuses the copied weights
    assert stats.weights is not None and torch.equal(stats.weights, buf.state_dict()["weights"])


class _Full(io.BytesIO):
    """A file with room for 300 bytes: a longer write raises ENOSPC."""

    def write(self, data: Any) -> int:
        if self.tell() + len(data) > 300:
            raise OSError(28, "No space left on device")
        return super().write(data)


def test_a_full_file_object_is_left_untouched_and_the_cause_named() -> None:
    """torch.save wrote 64 bytes into the caller's file, then raised "unexpected pos 64 vs 0"
    without the cause."""
    target = _Full()
    with pytest.raises(CheckpointError, match="No space left on device"):
        gb.save_checkpoint(target, model=nn.Linear(50, 50))
    assert target.getvalue() == b""
    closed = io.BytesIO()
    closed.close()
    with pytest.raises(ValueError, match="Invalid f: the file is closed"):
        gb.save_checkpoint(closed, model=nn.Linear(2, 2))


def test_a_map_location_that_names_no_device_is_named() -> None:
    """It was reported as a file that is not a checkpoint."""
    buffer = io.BytesIO()
    gb.save_checkpoint(buffer, model=nn.Linear(2, 2))
    buffer.seek(0)
    with pytest.raises(ValueError, match="Invalid map_location: 'bogus'"):
        gb.load_checkpoint(buffer, map_location="bogus", model=nn.Linear(2, 2))


def _mid_step() -> tuple[nn.Module, nn.ModuleList, gb.TaskGradBuffer, torch.Tensor]:
    torch.manual_seed(0)
    trunk, heads = nn.Linear(3, 4), nn.ModuleList([nn.Linear(4, 1) for _ in range(2)])
    buf = gb.TaskGradBuffer(trunk.parameters(), heads.parameters())
    return trunk, heads, buf, torch.randn(5, 3)


def test_a_buffer_that_refuses_a_load_mid_step_is_reported_unchanged() -> None:
    """A buffer mid-step refuses both the checkpoint and its own snapshot: it never changed,
    so the error said "left part-loaded" where nothing was; the model loaded before it is
    put back, and the step then finishes as if no load had been tried."""
    def run(try_load: bool) -> torch.Tensor:
        trunk, heads, buf, x = _mid_step()
        f = io.BytesIO()
        gb.save_checkpoint(f, trunk=trunk, buffer=buf, rng=False)
        with torch.no_grad():
            trunk.weight.add_(1.0)  # the checkpoint holds the weights before this
        h = trunk(x)
        buf.backward([head(h).pow(2).mean() for head in heads])
        if try_load:
            f.seek(0)
            before = trunk.weight.detach().clone()
            with pytest.raises(CheckpointError, match=r"during a step.*; nothing was changed$"):
                gb.load_checkpoint(f, trunk=trunk, buffer=buf)
            assert torch.equal(trunk.weight, before)  # loaded, then put back
        buf.apply_(UPGrad())
        return torch.cat([p.grad.flatten() for p in trunk.parameters()])

    assert torch.equal(run(True), run(False))


class _Appending:
    """A state whose failed load leaves it changed, and whose putting back fails too."""

    def __init__(self) -> None:
        self.items: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"items": list(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items.append(len(state["items"]))
        raise RuntimeError("half-way")


def test_an_object_changed_by_a_failed_load_is_reported_part_loaded() -> None:
    obj = _Appending()
    f = io.BytesIO()
    gb.save_checkpoint(f, obj=obj, rng=False)
    f.seek(0)
    with pytest.raises(CheckpointError, match=r"putting back \['obj'\] failed as well"):
        gb.load_checkpoint(f, obj=obj)
    assert obj.items == [0, 0]  # the load's change and the roll-back's: both reported
