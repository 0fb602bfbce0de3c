"""Progress of a sequence of training runs: a tqdm bar on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["Progress", "is_terminal"]


def is_terminal(stream: TextIO) -> bool:
    """Whether ``stream`` is an interactive terminal (False for files, pipes, closed streams)."""
    try:
        return bool(stream.isatty())
    except (AttributeError, OSError, ValueError):
        return False


class Progress:
    """One bar over all optimizer steps of all runs; one summary line per finished run.

    The bar is ``tqdm`` (``pip install gradbalance[progress]``), used only when ``bar`` is True,
    tqdm is installed and ``stream`` is a terminal. Otherwise (a log file, a pipe, CI) the
    output is plain lines without carriage returns: one per finished run,
    ``[3/8] pcgrad seed 1: ... [24/64 steps, 5 s elapsed, ~9 s left]``, and during a run one
    every ``every`` seconds with the steps done so far. ``runs`` is the number of runs (the
    ``[k/runs]`` prefix); ``clock`` returns seconds.
    """

    def __init__(self, total_steps: int, *, runs: int | None = None, bar: bool = True,
                 quiet: bool = False, stream: TextIO | None = None, every: float = 30.0,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if every <= 0:
            raise ValueError(f"every={every!r}: the seconds between plain lines must be > 0")
        self.total = total_steps
        self.runs = runs
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.every = every
        self.clock = clock
        self.done = 0
        self.finished = 0
        self.start = clock()
        self._last_line = self.start
        self._text = ""
        self._bar: Any = None
        if bar and not quiet and is_terminal(self.stream):
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total_steps, unit="step", file=self.stream,
                                 dynamic_ncols=True, leave=False)

    @property
    def uses_bar(self) -> bool:
        """Whether a tqdm bar is drawn (else plain lines)."""
        return self._bar is not None

    def describe(self, text: str) -> None:
        """Name the run in progress."""
        self._text = text
        if self._bar is not None:
            self._bar.set_description(text, refresh=False)

    def advance(self, steps: int = 1) -> None:
        self.done += steps
        if self._bar is not None:
            self._bar.update(steps)
        elif not self.quiet and self.clock() - self._last_line >= self.every:
            self._print(f"{self._prefix(self.finished + 1)}{self._text}: running "
                        f"{self._timing()}")

    def finished_run(self, text: str) -> None:
        """Report a finished run (above the bar, or as a plain line with an ETA)."""
        self.finished += 1
        if self.quiet:
            return
        line = f"{self._prefix(self.finished)}{text}  {self._timing()}"
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            self._print(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _prefix(self, run: int) -> str:
        if self.runs is None:
            return ""
        return f"[{min(run, self.runs)}/{self.runs}] "

    def _timing(self) -> str:
        elapsed = self.clock() - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        return f"[{self.done}/{self.total} steps, {elapsed:.0f} s elapsed, ~{left:.0f} s left]"

    def _print(self, line: str) -> None:
        print(line, file=self.stream, flush=True)
        self._last_line = self.clock()
