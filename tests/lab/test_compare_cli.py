"""``gradbalance compare`` / ``train``: every output file with its columns, Δm, errors."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
import torch

from gradbalance import BALANCERS
from gradbalance.balancers import Balancer
from gradbalance_lab._mtl_report import delta_m
from gradbalance_lab.cli import build_parser, main

pytest.importorskip("sklearn")

TINY = ["--n-train", "96", "--n-test", "40", "--epochs", "1", "--batch-size", "32",
        "--hidden", "8", "--no-progress"]


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_delta_m_hand_values() -> None:
    # accuracy 90 vs 100 (higher better): -10 %; MAE 2 vs 1 (lower better): -100 %
    assert delta_m([90.0, 2.0], [100.0, 1.0], [True, False]) == pytest.approx(-55.0)
    assert delta_m([110.0, 0.5], [100.0, 1.0], [True, False]) == pytest.approx(30.0)
    with pytest.raises(ValueError, match="one entry per task"):
        delta_m([1.0], [1.0, 2.0], [True, True])


def test_a_baseline_metric_of_zero_leaves_delta_m_blank() -> None:
    # a short run's 0 % accuracy: Δm divides by it; the report raised after every run
    from gradbalance_lab._mtl_methods import Method
    from gradbalance_lab._mtl_report import summarize
    from gradbalance_lab._mtl_runner import RunResult

    results = [RunResult(Method("single", "left", task=0), 0, [0.0, math.nan]),
               RunResult(Method("single", "right", task=1), 0, [math.nan, 25.0]),
               RunResult(Method("balancer", "sum"), 0, [10.0, 30.0])]
    rows = summarize(results, [True, True])
    assert [row.label for row in rows][-1] == "sum"
    assert all(math.isnan(row.delta_mean) for row in rows)
    # a non-zero baseline keeps Δm: (10 − 5)/5 and (30 − 25)/25 → 60 %
    results[0].metrics[0] = 5.0
    assert summarize(results, [True, True])[-1].delta_mean == pytest.approx(60.0)


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    out = tmp_path_factory.mktemp("compare")
    code = main(["compare", *TINY, "--seeds", "2", "--balancers", "sum,mean",
                 "--weightings", "none", "--out", str(out), "--log-every", "1"])
    return out, code


def test_compare_writes_every_output(compare_run: tuple[Path, int]) -> None:
    out, code = compare_run
    assert code == 0
    for name in ("summary.md", "summary.csv", "runs.csv", "history.csv", "config.json",
                 "compare.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = read_csv(out / "runs.csv")
    assert list(runs[0]) == ["method", "kind", "seed", "left_acc", "right_acc", "delta_m",
                             "step_ms", "steps", "seconds", "train_loss_left",
                             "train_loss_right", "error"]
    # 2 seeds × (2 single-task + sum + mean)
    assert sorted((r["method"], r["seed"]) for r in runs) == sorted(
        (m, s) for m in ("single-left", "single-right", "sum", "mean") for s in ("0", "1"))
    assert all(r["steps"] == "3" for r in runs)  # ceil(96 / 32) steps, 1 epoch
    summary = read_csv(out / "summary.csv")
    assert list(summary[0]) == ["method", "kind", "runs", "left_acc_mean", "left_acc_std",
                                "right_acc_mean", "right_acc_std", "delta_m_mean",
                                "delta_m_std", "step_ms", "x_plain_step", "failed", "note"]
    # the plain sum().backward() step: timed beside the methods, the reference of the ratios
    assert [r["method"] for r in summary] == ["single-task", "plain", "sum", "mean"]
    plain = next(r for r in summary if r["method"] == "plain")
    assert (plain["kind"], plain["runs"], float(plain["x_plain_step"])) == ("plain step", "0", 1.0)
    assert all(float(r["x_plain_step"]) > 0 for r in summary if r["kind"] == "balancer")
    history = read_csv(out / "history.csv")
    assert len(history) == len(runs) and {r["epoch"] for r in history} == {"1"}
    table = (out / "summary.md").read_text()
    for head in ("left acc %", "right acc %", "Δm %", "× plain step", "| plain | plain step |",
                 "| sum |", "| mean |"):
        assert head in table


def test_compare_delta_m_recomputed_from_runs(compare_run: tuple[Path, int]) -> None:
    out, _ = compare_run
    runs = read_csv(out / "runs.csv")
    base = [sum(float(r[m]) for r in runs if r["method"] == f"single-{t}") / 2
            for t, m in (("left", "left_acc"), ("right", "right_acc"))]
    for r in runs:
        if r["kind"] == "single":
            assert r["delta_m"] == ""
            continue
        expected = 50.0 * sum((float(r[m]) - b) / b for m, b in
                              zip(("left_acc", "right_acc"), base))
        assert float(r["delta_m"]) == pytest.approx(expected, rel=1e-5, abs=1e-4)
    summary = {r["method"]: r for r in read_csv(out / "summary.csv")}
    sums = [float(r["delta_m"]) for r in runs if r["method"] == "sum"]
    assert float(summary["sum"]["delta_m_mean"]) == pytest.approx(sum(sums) / 2, rel=1e-5)


def test_compare_tensorboard_logs(compare_run: tuple[Path, int]) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _ = compare_run
    for method in ("sum", "mean", "single-left"):
        for seed in (0, 1):
            folder = out / "tb" / method / f"seed{seed}"
            assert list(folder.glob("events.out.tfevents.*")), folder
    acc = EventAccumulator(str(out / "tb" / "sum" / "seed0"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"loss/task0", "loss/task1", "test/left_acc", "test/right_acc"} <= tags
    runs = read_csv(out / "runs.csv")
    logged = acc.Scalars("test/left_acc")[-1].value
    row = next(r for r in runs if r["method"] == "sum" and r["seed"] == "0")
    assert logged == pytest.approx(float(row["left_acc"]), rel=1e-5)


def test_train_single_balancer_outputs(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    code = main(["train", "--balancer", "mean", *TINY, "--out", str(tmp_path),
                 "--no-tensorboard"])
    assert code == 0
    assert torch.get_num_threads() == 2  # --threads 1 held only during the command
    torch.set_num_threads(before)
    assert (tmp_path / "train.png").is_file() and not (tmp_path / "tb").exists()
    runs = read_csv(tmp_path / "runs.csv")
    assert [(r["method"], r["seed"]) for r in runs] == [("mean", "0")]
    assert 0.0 <= float(runs[0]["left_acc"]) <= 100.0 and runs[0]["delta_m"] == ""


class _Boom(Balancer):
    name = "boom"

    def _combine_matrix(self, matrix, losses):
        raise RuntimeError("solver failed on purpose")


def test_a_failing_run_is_reported_not_fatal(tmp_path: Path, monkeypatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(BALANCERS, "boom", _Boom)
    code = main(["compare", *TINY, "--seeds", "1", "--balancers", "boom", "--weightings", "none",
                 "--no-baselines", "--no-tensorboard", "--no-plot", "--out", str(tmp_path)])
    assert code == 0
    runs = {r["method"]: r for r in read_csv(tmp_path / "runs.csv")}
    assert runs["boom"]["error"] == "RuntimeError: solver failed on purpose"
    assert runs["boom"]["left_acc"] == ""
    assert not math.isnan(float(runs["sum"]["left_acc"]))
    summary = {r["method"]: r for r in read_csv(tmp_path / "summary.csv")}
    assert summary["boom"]["failed"] == "1"
    assert "1/1 runs failed" in (tmp_path / "summary.md").read_text()
    assert "FAILED" in capsys.readouterr().err


def test_unknown_balancer_lists_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--balancers", "sum,nosuch", "--out", "unused"]) == 2
    err = capsys.readouterr().err
    assert "Unknown balancer 'nosuch' in --balancers" in err
    for name in BALANCERS:
        assert name in err


def test_unknown_weighting_and_train_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "--weightings", "nosuch", "--out", "unused"]) == 2
    assert "Unknown weighting 'nosuch' in --weightings; valid names:" in capsys.readouterr().err
    assert main(["train", "--out", "unused"]) == 2
    assert "exactly one of --balancer NAME or --weighting NAME" in capsys.readouterr().err
    assert main(["train", "--balancer", "nosuch", "--out", "unused"]) == 2
    assert "Unknown balancer 'nosuch' in --balancer; valid names:" in capsys.readouterr().err
    assert main(["train", "--balancer", "constant", "--out", "unused"]) == 2
    assert "needs settings (weights)" in capsys.readouterr().err
    assert not Path("unused").exists()


@pytest.mark.parametrize(("argv", "text"), [
    (["--epochs", "0"], "argument --epochs: invalid value: 0 (expected an int >= 1)"),
    (["--lr", "-1"], "argument --lr: invalid value: -1 (expected a finite number > 0)"),
    (["--trunk", "rnn"], "argument --trunk: invalid choice: 'rnn'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_options_exit_with_message(argv: list[str], text: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["compare", *argv])
    assert info.value.code == 2
    assert text in capsys.readouterr().err


@pytest.mark.parametrize("command", ["compare", "train"])
def test_help_explains_every_option(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    for action in sub._actions:
        assert action.help, f"{command} {action.option_strings} has no help"
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for action in sub._actions:
        for option in action.option_strings:
            assert option in text


def test_three_task_variant_signs_the_mae(tmp_path: Path) -> None:
    code = main(["compare", *TINY, "--seeds", "1", "--regression", "--balancers", "sum",
                 "--weightings", "none", "--no-tensorboard", "--no-plot",
                 "--weight-decay", "1e-5", "--out", str(tmp_path)])
    assert code == 0
    runs = {r["method"]: r for r in read_csv(tmp_path / "runs.csv")}
    assert {"left_acc", "right_acc", "sum_mae", "train_loss_sum"} <= set(runs["sum"])
    base = {m: float(runs[f"single-{t}"][m]) for t, m in
            (("left", "left_acc"), ("right", "right_acc"), ("sum", "sum_mae"))}
    mtl = {m: float(runs["sum"][m]) for m in base}
    # a lower MAE is better: its relative change enters Δm with a minus sign
    expected = 100.0 / 3 * ((mtl["left_acc"] - base["left_acc"]) / base["left_acc"]
                            + (mtl["right_acc"] - base["right_acc"]) / base["right_acc"]
                            - (mtl["sum_mae"] - base["sum_mae"]) / base["sum_mae"])
    assert float(runs["sum"]["delta_m"]) == pytest.approx(expected, rel=1e-5, abs=1e-4)
    assert "sum MAE ↓" in (tmp_path / "summary.md").read_text()


def test_weighting_parameters_are_trained_through_the_buffer(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gradbalance_lab._mtl_methods import available_weightings

    if "uncertainty" not in available_weightings():
        pytest.skip("Uncertainty Weighting is not in this installation")
    code = main(["train", "--weighting", "uncertainty", *TINY, "--log-every", "1",
                 "--no-plot", "--out", str(tmp_path)])
    assert code == 0
    acc = EventAccumulator(str(tmp_path / "tb" / "uncertainty" / "seed0"))
    acc.Reload()
    w = [e.value for e in acc.Scalars("w/task0")]
    losses = [e.value for e in acc.Scalars("loss/task0")]
    # Kendall et al., classification form: weight exp(-s); d/ds [exp(-s) L + s/2] = 0.5 - L
    # is negative while the cross-entropy L ≈ ln 10 > 0.5, so s grows and the weight falls
    assert len(w) == 3 and all(a > b for a, b in zip([1.0, *w], w))
    # logged losses are the task losses before weighting: near ln 10 at initialisation
    assert losses[0] == pytest.approx(math.log(10), abs=0.3)


def _train_losses(tmp_path: Path, name: str, *extra: str) -> list[float]:
    out = tmp_path / name
    # SGD (Adam would undo a common scale) for 2 epochs, so the clip shows in the losses
    code = main(["train", "--balancer", "mgda", "--baselines", *TINY, "--no-plot",
                 "--no-tensorboard", "--optimizer", "sgd", "--lr", "0.3", "--epochs", "2",
                 "--out", str(out), *extra])
    assert code == 0
    runs = read_csv(out / "runs.csv")
    assert all(r["error"] == "" for r in runs), runs
    return [float(r[key]) for r in runs for key in ("train_loss_left", "train_loss_right")
            if r[key] not in ("", "nan")]


def test_per_sample_clip_and_noise_in_the_main_job(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    plain = _train_losses(tmp_path, "plain")
    # a limit no per-sample gradient reaches: the same training, up to summation order
    loose = _train_losses(tmp_path, "loose", "--per-sample-clip", "1e9")
    assert loose == pytest.approx(plain, rel=1e-4)
    tight = _train_losses(tmp_path, "tight", "--per-sample-clip", "0.01")
    assert tight != pytest.approx(plain, rel=1e-3)  # the clip acts, single-task runs too
    noisy = _train_losses(tmp_path, "noisy", "--per-sample-clip", "0.01", "--noise", "1")
    assert noisy != tight  # the noise reaches the update (runs are otherwise deterministic)
    assert main(["train", "--balancer", "sum", "--noise", "1", "--out", "unused"]) == 2
    assert "--noise 1.0 needs --per-sample-clip C" in capsys.readouterr().err
    assert not Path("unused").exists()
