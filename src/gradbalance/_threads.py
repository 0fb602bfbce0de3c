"""One step, one thread: the ownership guard of a :class:`~gradbalance.TaskGradBuffer` (two
threads would mix their micro-batches)."""

from __future__ import annotations

import threading
from typing import Any


class StepOwner:
    """Raises ``RuntimeError`` on a concurrent call, or on a call from another thread than the
    one that began the step in progress; the check costs a lock and a thread id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.thread: int | None = None  # the thread of the step in progress

    def enter(self, call: str) -> None:
        """Before a call (``call`` names it in messages); pair it with :meth:`exit`."""
        self._take(call)
        me = threading.get_ident()
        if self.thread is not None and self.thread != me:
            self._lock.release()
            raise RuntimeError(
                f"TaskGradBuffer.{call}() called from another thread than the one that began "
                f"the step in progress; finish the step (apply_) in that thread, or call "
                f"reset() to drop it. Use one buffer per thread"
            )
        self.thread = me

    def exit(self, step_open: bool) -> None:
        """After a call (whether it raised or not); ``step_open``: a step is in progress now
        (it stays this thread's until it ends)."""
        if not step_open:
            self.thread = None
        self._lock.release()

    def drop(self, call: str) -> None:
        """The step is dropped (``reset``), from whichever thread: no owner."""
        self._take(call)
        self.thread = None
        self._lock.release()

    def _take(self, call: str) -> None:
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"TaskGradBuffer.{call}() called while another thread is inside this buffer; "
                f"a buffer holds one step: use one buffer per thread, or serialise whole steps"
            )

    def __reduce__(self) -> tuple[Any, ...]:
        return (StepOwner, ())  # a copy of a buffer starts without an owner
