"""The command line against hostile outputs and inputs: ``--out`` that is a file or cannot be
written, an existing folder (refused unless ``--overwrite``), Ctrl-C (the finished runs are
written, exit 130) and bad option values (one line, exit 2)."""

from __future__ import annotations

import csv
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

import gradbalance_lab.figures as figures
from gradbalance_lab._mtl_runner import RunResult, train_run
from gradbalance_lab.cli import main

pytest.importorskip("sklearn")

TIMEOUT = 120  # seconds per subprocess
CLI = [sys.executable, "-m", "gradbalance_lab"]
TINY = ["--n-train", "96", "--n-test", "40", "--epochs", "1", "--batch-size", "32",
        "--hidden", "8", "--no-progress", "--no-tensorboard", "--no-plot"]
#: the cheapest invocation of every command that writes into --out
COMMANDS = {
    "compare": ["compare", *TINY, "--seeds", "1", "--balancers", "sum", "--weightings", "none",
                "--no-baselines"],
    "train": ["train", "--balancer", "sum", *TINY],
    "figures": ["figures", "--quick", "--only", "clipping", "--no-plot"],
}


def _cli(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *argv], capture_output=True, text=True, timeout=TIMEOUT,
                          check=False, cwd=cwd)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _one_error_line(err: str, command: str) -> str:
    """The single stderr line of a refused invocation (no traceback)."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"gradbalance {command}: error: "), err
    return lines[0]


@pytest.fixture
def unwritable(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """An --out path the command cannot create, and the words of its error.

    Root ignores permissions, so there the path lies under a file (which fails for root too);
    otherwise under a folder without write permission (restored afterwards)."""
    if os.geteuid() == 0:
        (tmp_path / "file").write_text("not a folder")
        yield tmp_path / "file" / "sub", "is a file"
        return
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        yield locked / "sub", "is not writable"
    finally:
        locked.chmod(0o700)


def test_out_is_a_file_subprocess(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("a file")
    out = _cli([*COMMANDS["compare"], "--out", "taken"], tmp_path)
    assert out.returncode == 2, out.stderr
    line = _one_error_line(out.stderr, "compare")
    assert "--out taken: is a file" in line
    assert out.stdout == ""  # nothing built, nothing trained


def test_unwritable_out_subprocess(tmp_path: Path, unwritable: tuple[Path, str]) -> None:
    path, words = unwritable
    out = _cli([*COMMANDS["compare"], "--out", str(path)], tmp_path)
    assert out.returncode == 2, out.stderr
    line = _one_error_line(out.stderr, "compare")
    assert f"--out {path}: cannot create the folder" in line and words in line
    assert not path.exists()


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_refuses_a_bad_out(command: str, tmp_path: Path,
                                         unwritable: tuple[Path, str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    taken = tmp_path / "taken.txt"
    taken.write_text("a file")
    assert main([*COMMANDS[command], "--out", str(taken)]) == 2
    assert f"--out {taken}: is a file" in _one_error_line(capsys.readouterr().err, command)
    path, words = unwritable
    assert main([*COMMANDS[command], "--out", str(path)]) == 2
    assert words in _one_error_line(capsys.readouterr().err, command)
    if os.geteuid() != 0:  # an existing folder without write permission
        assert main([*COMMANDS[command], "--out", str(path.parent)]) == 2
        assert "the folder is not writable" in _one_error_line(capsys.readouterr().err, command)


def _stale_compare_outputs(out: Path) -> None:
    """The outputs of an earlier, different run, and a file of the user's."""
    out.mkdir()
    (out / "runs.csv").write_text("method,kind,seed\nold,balancer,7\n")
    (out / "compare.png").write_bytes(b"old plot")
    (out / "tb" / "old" / "seed7").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")


def test_existing_folder_refused_then_overwritten(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "runs"
    _stale_compare_outputs(out)
    refused = _cli([*COMMANDS["compare"], "--out", "runs"], tmp_path)
    assert refused.returncode == 2, refused.stderr
    line = _one_error_line(refused.stderr, "compare")
    assert "--out runs: the folder is not empty" in line and "--overwrite" in line
    assert (out / "runs.csv").read_text().endswith("old,balancer,7\n")  # untouched
    assert main([*COMMANDS["compare"], "--out", str(out), "--overwrite"]) == 0
    assert [(r["method"], r["seed"]) for r in _read_csv(out / "runs.csv")] == [("sum", "0")]
    # the earlier plot and TensorBoard logs are gone although this run writes neither
    assert not (out / "compare.png").exists() and not (out / "tb").exists()
    assert (out / "notes.txt").read_text() == "mine"


def test_empty_existing_folder_needs_no_flag(tmp_path: Path) -> None:
    assert main([*COMMANDS["train"], "--out", str(tmp_path)]) == 0
    assert [r["method"] for r in _read_csv(tmp_path / "runs.csv")] == ["sum"]


def test_figures_refuses_then_overwrites_only_its_outputs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "report.md").write_text("old report")
    (tmp_path / "momentum.png").write_bytes(b"old figure")
    (tmp_path / "clipping.png").write_bytes(b"old figure")
    (tmp_path / "notes.txt").write_text("mine")
    assert main([*COMMANDS["figures"], "--out", str(tmp_path)]) == 2
    assert "not empty" in _one_error_line(capsys.readouterr().err, "figures")
    assert main([*COMMANDS["figures"], "--out", str(tmp_path), "--overwrite"]) == 0
    assert "returns 50" in (tmp_path / "report.md").read_text(encoding="utf-8")
    # --only clipping --no-plot: clipping's old PNG goes (the new report has none); another
    # figure's PNG, not run here, stays (it was deleted)
    assert not (tmp_path / "clipping.png").exists()
    assert (tmp_path / "momentum.png").read_bytes() == b"old figure"
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_figures_checks_doc_up_front(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figs"
    argv = [*COMMANDS["figures"], "--out", str(out), "--doc"]
    assert main([*argv, str(tmp_path)]) == 2
    assert "--doc" in _one_error_line(capsys.readouterr().err, "figures")
    assert main([*argv, str(tmp_path / "missing" / "figures.md")]) == 2
    assert "does not exist" in _one_error_line(capsys.readouterr().err, "figures")
    # the output folder itself, not there yet: it failed after the run, with a traceback
    assert main([*argv, str(out)]) == 2
    assert "is the output folder" in _one_error_line(capsys.readouterr().err, "figures")
    if Path("/proc/self").is_dir():  # a folder no one can write, root included
        assert main([*argv, "/proc/gradbalance-figures.md"]) == 2
        assert "cannot be written" in _one_error_line(capsys.readouterr().err, "figures")
    assert not out.exists()  # refused before the output folder was made


def test_the_doc_is_written_whole_or_not_at_all(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from gradbalance_lab._cli_common import write_atomic

    doc = tmp_path / "figures.md"
    doc.write_text("the earlier page")

    def failing(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("gradbalance_lab._cli_common.os.replace", failing)
    with pytest.raises(OSError, match="No space"):
        write_atomic(doc, "the new page")
    assert doc.read_text() == "the earlier page"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["figures.md"]  # no temporary left


def test_the_doc_keeps_its_permissions_and_its_link(tmp_path: Path) -> None:
    import os
    import stat

    from gradbalance_lab._cli_common import write_atomic

    page = tmp_path / "page.md"
    page.write_text("old")
    os.chmod(page, 0o644)
    link = tmp_path / "link.md"
    link.symlink_to(page)
    write_atomic(link, "new")  # the temporary file's 0600 and a replaced link before
    assert link.is_symlink() and page.read_text() == "new"
    assert stat.S_IMODE(page.stat().st_mode) == 0o644
    mask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "fresh.md", "x")
    finally:
        os.umask(mask)
    assert stat.S_IMODE((tmp_path / "fresh.md").stat().st_mode) == 0o644


@pytest.mark.parametrize(("argv", "text"), [
    (["compare", "--seeds", "0"], "argument --seeds: invalid value: 0"),
    (["compare", "--epochs", "-2"], "argument --epochs: invalid value: -2"),
    (["train", "--n-train", "-5"], "argument --n-train: invalid value: -5"),
    (["compare", "--variant", "huge"], "argument --variant: invalid choice: 'huge'"),
    (["figures", "--threads", "0"], "argument --threads: invalid value: 0"),
    (["figures", "--only", "nope"], "argument --only: invalid choice: 'nope'"),
])
def test_bad_numbers_and_names_are_one_line(argv: list[str], text: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert text in _one_error_line(capsys.readouterr().err, argv[0])


@pytest.mark.parametrize(("argv", "text"), [
    (["compare", "--balancers", "nosuch"], "Unknown balancer 'nosuch' in --balancers"),
    (["train", "--weighting", "nosuch"], "Unknown weighting 'nosuch' in --weighting"),
])
def test_unknown_method_is_one_line(argv: list[str], text: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--out", str(tmp_path / "unused")]) == 2
    assert text in _one_error_line(capsys.readouterr().err, argv[0])
    assert not (tmp_path / "unused").exists()


def _lines(stream: IO[str], sink: queue.Queue[str]) -> None:
    for line in stream:
        sink.put(line)
    sink.put("")  # end of stream


def _finished(line: str) -> bool:
    """A progress line of a finished run (not the periodic ``running`` line)."""
    return line.startswith("[") and ": running [" not in line


def stop_after_first_run(argv: list[str], cwd: Path, sig: int) -> tuple[int, str]:
    """Run ``argv`` in ``cwd`` (stdout into ``stdout.txt``), send ``sig`` once a run has
    finished; returns the exit code and stderr."""
    # a child started with SIGINT ignored (a background job) would not see Ctrl-C
    with (cwd / "stdout.txt").open("w") as stdout:
        proc = subprocess.Popen(
            argv, cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    err: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, err), daemon=True).start()
    seen: list[str] = []
    try:
        while not any(_finished(line) for line in seen):
            seen.append(err.get(timeout=TIMEOUT))
            assert seen[-1], "".join(seen)  # the command ended before its first run finished
        proc.send_signal(sig)
        proc.wait(timeout=TIMEOUT)
        while (line := err.get(timeout=TIMEOUT)) != "":
            seen.append(line)
    finally:
        proc.kill()
        proc.wait()
    return proc.returncode, "".join(seen)


#: a compare of 20 runs of 63 steps into runs/: the first finishes long before the last
LONG = [*CLI, "compare", *TINY, "--n-train", "2000", "--seeds", "20", "--balancers", "sum",
        "--weightings", "none", "--no-baselines", "--out", "runs"]


def test_ctrl_c_writes_the_finished_runs_subprocess(tmp_path: Path) -> None:
    code, stderr = stop_after_first_run(LONG, tmp_path, signal.SIGINT)
    seen = stderr.splitlines(keepends=True)
    assert code == 130, stderr
    assert "Traceback" not in stderr
    finished = sum(_finished(line) for line in seen)
    assert 1 <= finished < 20
    assert seen[-1] == (f"gradbalance compare: interrupted: {finished} of 20 runs finished; "
                        "the summary and CSVs in runs/ hold those runs only\n")
    out = tmp_path / "runs"
    runs = _read_csv(out / "runs.csv")
    assert [(r["method"], r["seed"]) for r in runs] == [("sum", str(s)) for s in range(finished)]
    assert [(r["method"], r["runs"]) for r in _read_csv(out / "summary.csv")] == [
        ("plain", "0"), ("sum", str(finished))]  # the plain step: timed, not trained
    assert f"interrupted: {finished} of 20 runs finished" in (out / "summary.md").read_text()
    # the table of the finished runs is printed
    assert "| sum |" in (tmp_path / "stdout.txt").read_text()


def test_ctrl_c_in_process_drops_the_cut_short_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    calls: list[int] = []

    def interrupted_third(*args: Any, **kwargs: Any) -> RunResult:
        calls.append(1)
        if len(calls) == 3:
            tb = args[5]
            assert isinstance(tb, Path)
            tb.mkdir(parents=True)  # the cut-short run had started its logs
            raise KeyboardInterrupt
        return train_run(*args, **kwargs)

    monkeypatch.setattr("gradbalance_lab._mtl_cli.train_run", interrupted_third)
    argv = [*COMMANDS["compare"], "--seeds", "4", "--out", str(tmp_path)]
    argv.remove("--no-tensorboard")
    assert main(argv) == 130
    assert "interrupted: 2 of 4 runs finished" in capsys.readouterr().err
    assert [r["seed"] for r in _read_csv(tmp_path / "runs.csv")] == ["0", "1"]
    assert sorted(p.name for p in (tmp_path / "tb" / "sum").iterdir()) == ["seed0", "seed1"]


def test_ctrl_c_in_figures_reports_what_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    real = figures.run_one

    def interrupted_second(name: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if name == "loss_scale":
            raise KeyboardInterrupt
        return real(name, *args, **kwargs)

    monkeypatch.setattr(figures, "run_one", interrupted_second)
    doc = tmp_path / "doc.md"
    doc.write_text("the full report")
    out = tmp_path / "figs"
    code = main(["figures", "--quick", "--no-plot", "--only", "clipping", "loss_scale",
                 "--out", str(out), "--doc", str(doc)])
    assert code == 130
    err = capsys.readouterr().err
    assert "gradbalance figures: interrupted: 1 of 2 figures finished" in err
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "Interrupted: 1 of 2 figures finished." in report and "returns 50" in report
    assert doc.read_text() == "the full report"  # a partial report never replaces --doc
