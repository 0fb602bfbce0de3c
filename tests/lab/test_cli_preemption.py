"""A stopped command keeps every result: SIGTERM (SLURM, Kubernetes, ``timeout``) is handled
like Ctrl-C (the finished runs are written, exit 143), and an ``--overwrite`` rerun that is
stopped or killed leaves the earlier outputs as they were."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

import gradbalance_lab.figures as figures
from gradbalance_lab._mtl_report import write_csvs
from gradbalance_lab._mtl_runner import RunResult, train_run
from gradbalance_lab.cli import main
from lab.test_cli_outputs import COMMANDS, LONG, _finished, _read_csv, stop_after_first_run

pytest.importorskip("sklearn")

def _snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
            for p in sorted(folder.rglob("*"))}


def _earlier_run(out: Path) -> dict[str, bytes | None]:
    """A finished compare of seeds 0 and 1 in ``out`` (with a plot, TensorBoard logs and a
    file of the user's); returns its snapshot."""
    argv = [*COMMANDS["compare"], "--seeds", "2", "--out", str(out)]
    argv.remove("--no-tensorboard")
    argv.remove("--no-plot")
    assert main(argv) == 0
    (out / "notes.txt").write_text("mine")
    return _snapshot(out)


def _incomplete(parent: Path) -> list[Path]:
    return sorted(parent.glob("*.incomplete-*"))


def test_sigterm_writes_the_finished_runs_subprocess(tmp_path: Path) -> None:
    code, stderr = stop_after_first_run(LONG, tmp_path, signal.SIGTERM)
    assert code == 143, stderr
    assert "Traceback" not in stderr
    finished = sum(_finished(line) for line in stderr.splitlines(keepends=True))
    assert 1 <= finished < 20
    assert stderr.endswith(f"gradbalance compare: interrupted: {finished} of 20 runs finished; "
                           "the summary and CSVs in runs/ hold those runs only\n")
    runs = _read_csv(tmp_path / "runs" / "runs.csv")
    assert [(r["method"], r["seed"]) for r in runs] == [("sum", str(s)) for s in range(finished)]
    assert "| sum |" in (tmp_path / "stdout.txt").read_text()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_overwrite_keeps_the_earlier_outputs_subprocess(tmp_path: Path,
                                                                  sig: int) -> None:
    out = tmp_path / "runs"
    before = _earlier_run(out)
    code, stderr = stop_after_first_run([*LONG, "--overwrite"], tmp_path, sig)
    assert _snapshot(out) == before  # not one byte of the earlier outputs moved
    staged = _incomplete(tmp_path)
    assert len(staged) == 1 and staged[0].name.startswith("runs.incomplete-")
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
        return
    assert code == 143, stderr
    finished = len(_read_csv(staged[0] / "runs.csv"))
    assert 1 <= finished < 20
    assert stderr.endswith(f"the earlier outputs in runs/ are kept; the summary and CSVs of "
                           f"those runs are in {staged[0]}/\n")


def _killing(at: int, sig: int) -> Any:
    """A ``train_run`` that sends ``sig`` to this process on its call number ``at``."""
    calls: list[int] = []

    def run(*args: Any, **kwargs: Any) -> RunResult:
        calls.append(1)
        if len(calls) == at:
            os.kill(os.getpid(), sig)
        return train_run(*args, **kwargs)
    return run


@pytest.mark.parametrize(("command", "seeds", "at"), [("compare", 3, 2), ("compare", 4, 4),
                                                      ("train", 3, 1), ("train", 2, 2)])
def test_sigterm_in_process(command: str, seeds: int, at: int, tmp_path: Path,
                            monkeypatch: pytest.MonkeyPatch,
                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("gradbalance_lab._mtl_cli.train_run", _killing(at, signal.SIGTERM))
    handler = signal.getsignal(signal.SIGTERM)
    assert main([*COMMANDS[command], "--seeds", str(seeds), "--out", str(tmp_path)]) == 143
    assert signal.getsignal(signal.SIGTERM) == handler  # restored after the command
    assert f"interrupted: {at - 1} of {seeds} runs finished" in capsys.readouterr().err
    runs = _read_csv(tmp_path / "runs.csv")
    assert [r["seed"] for r in runs] == [str(s) for s in range(at - 1)]


@pytest.mark.parametrize("at", [1, 2])
def test_stopped_overwrite_in_process_keeps_the_earlier_outputs(
        at: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs"
    before = _earlier_run(out)
    monkeypatch.setattr("gradbalance_lab._mtl_cli.train_run", _killing(at, signal.SIGTERM))
    argv = [*COMMANDS["compare"], "--seeds", "3", "--out", str(out), "--overwrite"]
    assert main(argv) == 143
    assert "the earlier outputs in" in capsys.readouterr().err
    assert _snapshot(out) == before
    [staged] = _incomplete(tmp_path)
    assert [r["seed"] for r in _read_csv(staged / "runs.csv")] == [str(s) for s in range(at - 1)]
    # a rerun that completes replaces the earlier outputs and removes its own staging folder
    monkeypatch.setattr("gradbalance_lab._mtl_cli.train_run", train_run)
    assert main(argv) == 0
    assert [r["seed"] for r in _read_csv(out / "runs.csv")] == ["0", "1", "2"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "history.csv", "notes.txt",
                                                     "runs.csv", "summary.csv", "summary.md"]
    assert _incomplete(tmp_path) == [staged]  # the stopped run's folder is the user's to keep


def test_a_failure_while_writing_leaves_the_earlier_outputs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "runs"
    before = _earlier_run(out)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("disk went away")

    monkeypatch.setattr("gradbalance_lab._mtl_outputs.write_csvs", broken)
    with pytest.raises(RuntimeError, match="disk went away"):
        main([*COMMANDS["compare"], "--out", str(out), "--overwrite"])
    assert _snapshot(out) == before
    assert _incomplete(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_stopped_figures_overwrite_keeps_the_earlier_report(
        sig: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figs"
    out.mkdir()
    (out / "report.md").write_text("old report")
    (out / "clipping.png").write_bytes(b"old figure")
    real = figures.run_one

    def stopped_second(name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if name == "loss_scale":
            os.kill(os.getpid(), sig)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(figures, "run_one", stopped_second)
    # Python leaves SIGINT ignored in a process started as a background job (`cmd &`): Ctrl-C
    # is the terminal's, so this test installs the handler an interactive run has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = main(["figures", "--quick", "--no-plot", "--only", "clipping", "loss_scale",
                     "--out", str(out), "--overwrite"])
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == (143 if sig == signal.SIGTERM else 130)
    assert "1 of 2 figures finished" in capsys.readouterr().err
    assert (out / "report.md").read_text() == "old report"
    assert (out / "clipping.png").read_bytes() == b"old figure"
    [staged] = _incomplete(tmp_path)
    assert "Interrupted: 1 of 2 figures finished." in (staged / "report.md").read_text()


@pytest.mark.parametrize("overwrite", [False, True])
def test_sigterm_while_writing_lets_the_outputs_complete(
        overwrite: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "runs"
    if overwrite:
        _earlier_run(out)
    real = write_csvs

    def terminated_while_writing(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr("gradbalance_lab._mtl_outputs.write_csvs", terminated_while_writing)
    argv = [*COMMANDS["compare"], "--seeds", "3", "--out", str(out)]
    assert main([*argv, "--overwrite"] if overwrite else argv) == 0  # every run had finished
    assert [r["seed"] for r in _read_csv(out / "runs.csv")] == ["0", "1", "2"]
    assert (out / "summary.md").exists() and (out / "config.json").exists()
    assert _incomplete(tmp_path) == []
