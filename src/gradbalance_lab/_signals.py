"""SIGTERM handled like Ctrl-C while a command runs.

SLURM, Kubernetes and ``timeout`` stop a job with SIGTERM. While :func:`sigterm_as_interrupt`
is active, the first SIGTERM raises :class:`Terminated`, a :class:`KeyboardInterrupt`, so
every command's Ctrl-C path runs: the finished runs' outputs are written. Later SIGTERMs are
ignored so that this writing completes (SIGKILL still stops the process), and so is one that
comes while the outputs are written (:func:`shielded`): the run is complete by then.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["Terminated", "shielded", "sigterm_as_interrupt"]

#: Set while :func:`shielded` runs: a SIGTERM is then recorded, not raised.
_SHIELD: list[bool] = []


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
        if not received and not _SHIELD:
            received.append(signum)
            raise Terminated(f"signal {signum}")
        received.append(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def shielded() -> Iterator[None]:
    """Within the block (the outputs being written) SIGTERM does not interrupt."""
    _SHIELD.append(True)
    try:
        yield
    finally:
        _SHIELD.pop()
