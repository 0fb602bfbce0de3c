"""SIGTERM handled like Ctrl-C while a command runs.

SLURM, Kubernetes and ``timeout`` stop a job with SIGTERM. While :func:`sigterm_as_interrupt`
is active, the first SIGTERM raises :class:`Terminated`, a :class:`KeyboardInterrupt`, so
every command's Ctrl-C path runs: the finished runs' outputs are written. Later SIGTERMs are
ignored so that this writing completes (SIGKILL still stops the process).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["Terminated", "sigterm_as_interrupt"]


class Terminated(KeyboardInterrupt):
    """Raised by the first SIGTERM while :func:`sigterm_as_interrupt` is active."""


@contextmanager
def sigterm_as_interrupt() -> Iterator[list[int]]:
    """Within the block SIGTERM raises :class:`Terminated` once; yields the list of the
    signals received (empty unless one came). Outside the main thread, or where SIGTERM is
    ignored (as Python leaves Ctrl-C alone where SIGINT is), it does nothing."""
    received: list[int] = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) == signal.SIG_IGN):
        yield received
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if not received:
            received.append(signum)
            raise Terminated(f"signal {signum}")
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)
