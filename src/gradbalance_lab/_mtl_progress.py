"""Progress of a sequence of training runs: tqdm when installed, plain text otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["Progress"]


class Progress:
    """One bar over all optimizer steps of all runs; one summary line per finished run.

    Uses ``tqdm`` (``pip install gradbalance[progress]``) when available and ``bar`` is True;
    otherwise prints a line per run, with the elapsed time and an estimate of the time left.
    """

    def __init__(self, total_steps: int, *, bar: bool = True, quiet: bool = False,
                 stream: TextIO | None = None) -> None:
        self.total = total_steps
        self.quiet = quiet
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.start = time.perf_counter()
        self._bar: Any = None
        if bar and not quiet:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total_steps, unit="step", file=self.stream,
                                 dynamic_ncols=True, leave=False)

    def describe(self, text: str) -> None:
        """Name the run in progress."""
        if self._bar is not None:
            self._bar.set_description(text, refresh=False)

    def advance(self, steps: int = 1) -> None:
        self.done += steps
        if self._bar is not None:
            self._bar.update(steps)

    def finished_run(self, text: str) -> None:
        """Report a finished run (above the bar, or as a plain line with an ETA)."""
        if self.quiet:
            return
        elapsed = time.perf_counter() - self.start
        left = elapsed / self.done * (self.total - self.done) if self.done else 0.0
        line = f"{text}  [{self.done}/{self.total} steps, {elapsed:.0f}s, ~{left:.0f}s left]"
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
