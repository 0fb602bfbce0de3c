"""Progress display: a tqdm bar on a terminal only; plain periodic lines (no carriage returns)
to a file or pipe, from the class and from ``gradbalance compare``."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradbalance_lab._mtl_progress import Progress, is_terminal

TIMEOUT = 300  # seconds for the end-to-end command


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_lines_off_a_terminal() -> None:
    stream, clock = io.StringIO(), Clock()
    progress = Progress(8, runs=2, stream=stream, every=10.0, clock=clock)
    assert not progress.uses_bar  # tqdm is never drawn into a file or a pipe
    progress.describe("pcgrad seed 1")
    clock.now += 4.0
    progress.advance()  # 4 s since the start: below `every`, silent
    assert stream.getvalue() == ""
    clock.now += 6.0
    progress.advance()  # 10 s: one periodic line
    clock.now += 3.0
    progress.advance(2)  # 3 s after that line: silent
    clock.now += 1.0
    progress.finished_run("pcgrad seed 1: 3.2 s")
    progress.describe("sum seed 1")
    progress.advance(4)
    progress.finished_run("sum seed 1: 0.5 s")
    progress.close()
    lines = stream.getvalue().splitlines()
    assert lines == [
        "[1/2] pcgrad seed 1: running [2/8 steps, 10 s elapsed, ~30 s left]",
        "[1/2] pcgrad seed 1: 3.2 s  [4/8 steps, 14 s elapsed, ~14 s left]",
        "[2/2] sum seed 1: 0.5 s  [8/8 steps, 14 s elapsed, ~0 s left]",
    ]
    assert "\r" not in stream.getvalue()


def test_quiet_writes_nothing() -> None:
    stream, clock = io.StringIO(), Clock()
    progress = Progress(2, runs=1, quiet=True, stream=FakeTerminal(), clock=clock)
    assert not progress.uses_bar
    progress = Progress(2, runs=1, quiet=True, stream=stream, every=1.0, clock=clock)
    clock.now += 5.0
    progress.advance(2)
    progress.finished_run("sum seed 0")
    assert stream.getvalue() == ""


def test_bar_on_a_terminal() -> None:
    pytest.importorskip("tqdm")
    stream = FakeTerminal()
    progress = Progress(4, runs=1, stream=stream)
    assert progress.uses_bar
    progress.describe("sum seed 0")
    progress.advance(4)
    progress.finished_run("sum seed 0: 0.1 s")
    progress.close()
    assert "\r" in stream.getvalue()  # tqdm redraws in place
    assert "[1/1] sum seed 0: 0.1 s" in stream.getvalue()


def test_terminal_without_tqdm_or_with_no_progress(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not Progress(4, stream=FakeTerminal(), bar=False).uses_bar  # --no-progress
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    stream = FakeTerminal()
    progress = Progress(4, runs=1, stream=stream)
    assert not progress.uses_bar
    progress.advance(4)
    progress.finished_run("sum seed 0")
    assert "\r" not in stream.getvalue() and stream.getvalue().startswith("[1/1] sum seed 0")


def test_is_terminal_of_odd_streams() -> None:
    assert is_terminal(FakeTerminal()) and not is_terminal(io.StringIO())
    closed = io.StringIO()
    closed.close()
    assert not is_terminal(closed)  # isatty raises ValueError on a closed stream
    assert not is_terminal(object())  # type: ignore[arg-type]


def test_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"every=0: the seconds between plain lines must be > 0"):
        Progress(1, every=0)


def test_compare_into_a_pipe_prints_lines_not_a_bar(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    argv = [sys.executable, "-m", "gradbalance", "compare", "--n-train", "64", "--n-test", "20",
            "--epochs", "1", "--batch-size", "32", "--hidden", "4", "--seeds", "1",
            "--balancers", "sum,pcgrad", "--weightings", "none", "--no-tensorboard",
            "--no-plot", "--out", str(tmp_path)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    assert out.returncode == 0, out.stderr
    assert "\r" not in out.stderr and "\r" not in out.stdout
    runs = re.findall(r"^\[(\d)/4\] (\S+) +seed 0: .*\[(\d+)/8 steps, ", out.stderr, re.M)
    assert runs == [("1", "single-left", "2"), ("2", "single-right", "4"), ("3", "sum", "6"),
                    ("4", "pcgrad", "8")], out.stderr
