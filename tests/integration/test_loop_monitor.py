"""Logging: every tag of docs/loop.md, read back by TensorBoard; dict, CSV, variability."""

from __future__ import annotations

import csv
import math
import statistics
from pathlib import Path

import pytest
import torch

from gradbalance import (
    CSVLogger,
    RunningStats,
    TaskClip,
    TaskGradBuffer,
    log_stats,
    stats_to_dict,
    summary_writer,
)
from gradbalance.balancers import Sum
from support.helpers import build, losses_of

K = 3


def _run(steps: int, scaler: torch.amp.GradScaler | None = None):
    """A short run: yields (step, stats, pre_clip, skipped, raw losses, true G)."""
    model, x, y = build("mlp", num_tasks=K)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    for step in range(steps):
        losses = losses_of(model, x, y)
        true_G = torch.stack([
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                losses[k], model.shared_parameters(), retain_graph=True)])
            for k in range(K)
        ])
        buf.backward(losses, scaler=scaler)
        stats = buf.apply_(Sum(), scaler=scaler, clip=TaskClip(100.0))
        if scaler is not None:
            s = scaler.get_scale()
            scaler.unscale_(opt)
        pre_clip = torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            skipped = scaler.get_scale() < s
        else:
            opt.step()
            skipped = False
        opt.zero_grad(set_to_none=True)
        yield step, stats, pre_clip, skipped, losses.detach(), true_G


def _expected(losses, true_G, pre_clip, skipped) -> dict[str, float]:
    """Seed §13's computation, written out independently of the library."""
    out = {}
    for k in range(K):
        out[f"loss/task{k}"] = losses[k].item()
        out[f"size/task{k}"] = true_G[k].norm().item()
        out[f"w/task{k}"] = 1.0
        out[f"pre_clip/task{k}"] = true_G[k].norm().item()
    for i in range(K):
        for j in range(i + 1, K):
            g1, g2 = true_G[i], true_G[j]
            out[f"cos/task{i}_task{j}"] = (g1 @ g2 / (g1.norm() * g2.norm())).item()
    out["pre_clip"] = float(pre_clip)
    out["amp_skipped"] = float(skipped)
    return out


def test_tensorboard_event_files_hold_every_tag(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    writer = summary_writer(tmp_path)
    running = RunningStats(window=3)
    expected: dict[str, list[tuple[int, float]]] = {}
    for step, stats, pre_clip, skipped, losses, true_G in _run(4, scaler):
        written = log_stats(writer, stats, step, pre_clip=pre_clip, amp_skipped=skipped,
                            running=running)
        for tag, value in _expected(losses, true_G, pre_clip, skipped).items():
            expected.setdefault(tag, []).append((step, value))
            assert written[tag] == pytest.approx(value, rel=1e-4, abs=1e-6)
    writer.close()
    acc = EventAccumulator(str(tmp_path)).Reload()
    tags = set(acc.Tags()["scalars"])
    assert set(expected) <= tags
    for tag, series in expected.items():
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [s for s, _ in series]
        for e, (_, value) in zip(events, series):
            assert e.value == pytest.approx(value, rel=1e-4, abs=1e-6), tag
    # variability: population std of the last 3 losses of task 0
    losses0 = [v for _, v in expected["loss/task0"]]
    last = acc.Scalars("std/loss/task0")[-1].value
    assert last == pytest.approx(statistics.pstdev(losses0[-3:]), rel=1e-4, abs=1e-7)
    assert acc.Scalars("std/loss/task0")[0].value == 0.0


def test_size_is_unscaled_under_amp() -> None:
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    for _, stats, _, _, _, true_G in _run(1, scaler):
        assert stats.loss_scale == 65536.0
        torch.testing.assert_close(stats.task_norms, true_G.norm(dim=1).double(), rtol=1e-5,
                                   atol=0)


def test_amp_skipped_defaults_to_found_inf() -> None:
    w = torch.ones(2, requires_grad=True)
    scaler = torch.amp.GradScaler("cpu")
    buf = TaskGradBuffer([w])
    buf.backward([w.sum() * float("inf"), w.sum()], scaler=scaler)
    stats = buf.apply_(Sum(), scaler=scaler)
    assert stats.found_inf
    assert stats_to_dict(stats)["amp_skipped"] == 1.0
    buf.backward([w.sum(), w.sum()])
    assert stats_to_dict(buf.apply_(Sum()))["amp_skipped"] == 0.0


def test_csv_route_without_tensorboard(tmp_path) -> None:
    path = tmp_path / "log.csv"
    rows = []
    running = RunningStats(window=2)
    with CSVLogger(path) as logger:
        for step, stats, pre_clip, skipped, losses, true_G in _run(3):
            scalars = stats_to_dict(stats, pre_clip=pre_clip)
            scalars.update(running.update(scalars))
            logger.log(scalars, step)
            rows.append(_expected(losses, true_G, pre_clip, skipped))
    with open(path, newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(r["step"]) for r in table] == [0, 1, 2]
    for row, exp in zip(table, rows):
        for tag, value in exp.items():
            assert float(row[tag]) == pytest.approx(value, rel=1e-4, abs=1e-6), tag
    l0 = [r["loss/task0"] for r in rows]
    assert float(table[2]["std/loss/task0"]) == pytest.approx(
        statistics.pstdev(l0[1:]), rel=1e-4, abs=1e-7)


def test_weights_override_and_errors() -> None:
    w = torch.ones(2, requires_grad=True)
    buf = TaskGradBuffer([w])
    buf.backward([w.sum(), 2 * w.sum()])
    stats = buf.apply_(Sum())
    d = stats_to_dict(stats, weights=torch.tensor([0.25, 1.75]))
    assert (d["w/task0"], d["w/task1"]) == (0.25, 1.75)
    assert d["cos/task0_task1"] == pytest.approx(1.0)
    assert "pre_clip" not in d
    with pytest.raises(ValueError, match="weights has 3 entries but the step has 2 tasks"):
        stats_to_dict(stats, weights=torch.ones(3))
    with pytest.raises(ValueError, match="without add_scalar"):
        log_stats(object(), stats, 0)
    with pytest.raises(ValueError, match=r"Invalid window: 1"):
        RunningStats(window=1)


def test_log_stats_writes_a_row_of_a_csv_logger(tmp_path: Path) -> None:
    """``log_stats(CSVLogger(...), ...)`` (the README's loop) writes one row per step, the
    logger's task names in the tags; read back with the csv module."""
    w = torch.ones(2, requires_grad=True)
    buf = TaskGradBuffer([w])
    path = tmp_path / "run.csv"
    with CSVLogger(path, task_names=["depth", "seg"]) as log:
        for step in range(2):
            buf.backward([w.sum(), 2 * w.sum()])  # losses 2 and 4, gradients (1, 1), (2, 2)
            written = log_stats(log, buf.apply_(Sum()), step, pre_clip=3.0)
    rows = list(csv.DictReader(path.open()))
    assert [row["step"] for row in rows] == ["0", "1"]
    assert (float(rows[1]["loss/depth"]), float(rows[1]["loss/seg"])) == (2.0, 4.0)
    assert float(rows[1]["pre_clip"]) == 3.0
    assert set(rows[1]) == {"step", *written}


def test_a_step_reusing_weights_logs_losses_and_weights_only() -> None:
    w = torch.ones(2, requires_grad=True)
    buf = TaskGradBuffer([w], update_every=2)
    for _ in range(2):
        buf.backward([w.sum(), 2 * w.sum()])  # losses 2 and 4 at w = (1, 1)
        stats = buf.apply_(Sum())
    assert stats.weights_reused
    assert stats_to_dict(stats) == {"loss/task0": 2.0, "loss/task1": 4.0, "w/task0": 1.0,
                                    "w/task1": 1.0, "amp_skipped": 0.0}


def test_running_stats_state_round_trip() -> None:
    a = RunningStats(window=4)
    for v in (1.0, 5.0, math.nan, 2.0):
        a.update({"x": v, "amp_skipped": 1.0})
    b = RunningStats(window=4)
    b.load_state_dict(a.state_dict())
    assert a.update({"x": 7.0}) == b.update({"x": 7.0})
    assert b.update({"x": 3.0})["std/x"] == pytest.approx(statistics.pstdev([5, 2, 7, 3]))
    assert "std/amp_skipped" not in b.update({"amp_skipped": 0.0, "x": 1.0})
    b.reset()
    assert b.update({"x": 1.0}) == {"std/x": 0.0}
