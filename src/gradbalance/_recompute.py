"""Module state that a checkpoint's recomputation changes, counted once per graph.

A segment under ``torch.utils.checkpoint(..., use_reentrant=False)`` runs its forward again
in each backward that needs its saved tensors: plain ``sum(losses).backward()`` recomputes it
once, the balanced step's K passes (``passes="loop"``) K times, each in its own graph task.
A module whose forward changes its buffers (``BatchNorm``'s running statistics, a step count)
would take K updates where plain PyTorch takes one: 0.8 of the running mean's size off at
K = 3 (docs/loop.md, "Inputs plain PyTorch takes").

:class:`RecomputeGuard` keeps plain PyTorch's count. While it is active, global forward hooks
see every module run inside a backward (``torch._C._current_graph_task_id() ≥ 0``: a
recomputation; no module runs there without one, so a step without checkpoints pays nothing
but two hook registrations). A module's buffers change in the first graph task that
recomputes it for a micro-batch's graph (the graph named by its ``TaskRoots.graph``); in every
later one they are put back after its forward. A module shared by two segments that
different tasks reach, whose recomputation in a segment the counting task did not recompute
changes its buffers, is refused (plain PyTorch recomputes each segment once, in its own
order; the segment is the checkpoint frame found up the stack). When the guarded call
raises, every recomputed module's buffers are put back to what they were before the call
(a refused ``passes="batched"`` try, which recomputed a segment before vmap refused its
dropout, no longer moves the running statistics). State outside buffers (attributes a
forward sets) is not seen.

Example:
    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> bn = torch.nn.BatchNorm1d(2)
    >>> y = checkpoint(bn, torch.randn(4, 2, requires_grad=True), use_reentrant=False)
    >>> guard = RecomputeGuard()
    >>> with guard.call(graph=0, first=True):
    ...     for _ in range(3):  # three backward passes, one recomputation counted
    ...         _ = torch.autograd.grad(y.sum(), bn.weight, retain_graph=True)
    >>> int(bn.num_batches_tracked)  # the forward and one recomputation, as plain PyTorch
    2
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import weakref
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["LARGEST_COPIED", "RecomputeGuard", "new_graph", "passes_on"]

#: Buffers larger than this (elements), and those that cannot be written in place (an
#: expanded or inference tensor), are not copied: their version counter is kept instead and
#: a recomputation that changes one raises (a 64 MB constant buffer took 1.6 → 74 ms per
#: ``backward`` when copied every pass).
LARGEST_COPIED = 1 << 16
#: A buffer as it was: the tensor, a copy of its value (None where not copied), its version.
Saved = tuple[Tensor, "Tensor | None", int]
#: One module's buffers as they were, by name.
Buffers = dict[str, Saved]

_GRAPHS = itertools.count()


def new_graph() -> int:
    """A number for a new micro-batch graph (``TaskRoots.graph``, the per-sample route's)."""
    return next(_GRAPHS)


def _copied(buffer: Tensor) -> bool:
    """Whether :func:`_saved` copies ``buffer`` (small, written in place)."""
    return (buffer.numel() <= LARGEST_COPIED and not buffer.is_inference()
            and not (buffer.numel() > 1 and 0 in buffer.stride()))


def _saved(module: nn.Module) -> Buffers:
    """The module's own buffers as they are now."""
    return {name: (b, b.detach().clone() if _copied(b) else None, _version(b))
            for name, b in module._buffers.items() if b is not None}


def _version(buffer: Tensor) -> int:
    """Its version counter; -1 for an inference tensor (none, and never written here)."""
    return -1 if buffer.is_inference() else buffer._version


def _put_back(module: nn.Module, saved: Buffers) -> None:
    """Each buffer the same tensor as in ``saved``, with its value then."""
    with torch.no_grad():
        for name, (buffer, value, version) in saved.items():
            if value is not None:
                buffer.copy_(value)
            elif _version(buffer) != version:
                raise RuntimeError(
                    f"a module under torch.utils.checkpoint ({type(module).__name__}) changed "
                    f"its buffer {name!r} ({buffer.numel()} elements) when recomputed: the "
                    f"balanced step, which reruns the segment once per task, keeps plain "
                    f"PyTorch's one recomputation per micro-batch by putting buffers back, "
                    f"and copies those of at most {LARGEST_COPIED} elements only; keep such "
                    f"a buffer outside the checkpointed segment (docs/loop.md, \"Inputs "
                    f"plain PyTorch takes\")")
            if module._buffers.get(name) is not buffer:
                module._buffers[name] = buffer


def _graph_task() -> int:
    """The running backward's graph task, -1 outside a backward."""
    return int(torch._C._current_graph_task_id())


def _segment() -> int | None:
    """The checkpointed segment being recomputed: the identity of the innermost
    ``torch.utils.checkpoint`` frame whose unpack hook runs the recomputation (the ``frame``
    its hook reads), found up the Python stack; None where there is none to be found."""
    kind = getattr(torch.utils.checkpoint, "_CheckpointFrame", None)
    if kind is None:
        return None
    at: FrameType | None = sys._getframe(1)
    while at is not None:
        if at.f_code.co_name == "unpack_hook":
            frame = at.f_locals.get("frame")
            if isinstance(frame, kind):
                return id(frame)
        at = at.f_back
    return None


#: The guards active in this thread, innermost last (:func:`passes_on` finds its own there).
_ACTIVE = threading.local()


def _active() -> list[RecomputeGuard]:
    stack: list[RecomputeGuard] | None = getattr(_ACTIVE, "stack", None)
    if stack is None:
        stack = _ACTIVE.stack = []
    return stack


@contextlib.contextmanager
def passes_on(graph: int) -> Iterator[None]:
    """Backward passes through the micro-batch graph ``graph`` (its ``TaskRoots.graph``),
    where it is not the current call's (a second micro-batch redoing the first one's passes);
    nothing where no guard is active."""
    stack = _active()
    if not stack:
        yield
        return
    guard = stack[-1]
    before, guard.graph = guard.graph, graph
    try:
        yield
    finally:
        guard.graph = before


class RecomputeGuard:
    """Counts each recomputed module's buffer changes once per micro-batch graph (module
    docstring), for one step at a time in the process.

    :meth:`call` guards one call of the step (a micro-batch's ``backward``, ``graph`` its
    roots' number; ``first`` at a step's first call, which forgets the last step's graphs):
    the first graph task that recomputes a module for a graph keeps its changes; a later one
    starts each of the module's calls from the state the counted one started from (the same
    output where the forward reads its buffers: a spectral norm's power iteration) and puts
    the buffers back once it has ended. :meth:`later` guards a later backward through the
    last call's graph (``apply_``'s write-back). :func:`passes_on` names another graph for
    the passes inside it.
    """

    def __init__(self) -> None:
        self.graph = -1  # the graph the passes now run through
        self._counted: dict[tuple[int, int], int] = {}  # (module, graph) → its counted task
        self._starts: dict[tuple[int, int], list[Buffers]] = {}  # each counted call's start
        self._before: dict[int, tuple[weakref.ref[nn.Module], Buffers]] = {}  # for a raise
        # the modules an uncounted task recomputes: their buffers before it, and its number
        self._pending: dict[int, tuple[weakref.ref[nn.Module], Buffers, int]] = {}
        self._calls: dict[tuple[int, int], int] = {}  # (module, task) → its calls so far
        # module → the checkpointed segments its counted tasks recomputed it in (a segment
        # is one forward's: a later graph's passes may run through an earlier one's)
        self._segments: dict[int, set[int]] = {}
        self._probes: dict[int, Buffers] = {}  # module → its buffers before a probed call

    @contextlib.contextmanager
    def call(self, graph: int, first: bool) -> Iterator[None]:
        """One call of the step through the micro-batch graph ``graph``."""
        if first:
            self._counted, self._starts, self._segments = {}, {}, {}
        self.graph = graph
        with self.later():
            yield

    @contextlib.contextmanager
    def later(self) -> Iterator[None]:
        """A backward through the graph of the last :meth:`call`."""
        self._before, self._pending, self._calls, self._probes = {}, {}, {}, {}
        stack = _active()
        stack.append(self)
        hooks = (nn.modules.module.register_module_forward_pre_hook(self._pre),
                 nn.modules.module.register_module_forward_hook(self._post))
        try:
            yield
            self._flush(None)
        except BaseException:
            self._restore_all()
            raise
        finally:
            for hook in hooks:
                hook.remove()
            stack.pop()
            self._before, self._pending, self._calls, self._probes = {}, {}, {}, {}

    def _pre(self, module: nn.Module, args: Any) -> None:
        task = _graph_task()
        if task < 0 or not module._buffers:
            return
        self._flush(task)  # a new graph task: the ones before it have ended
        mid = id(module)
        key = (mid, self.graph)
        now: Buffers | None = None  # the buffers before this forward, copied once
        if mid not in self._before:
            now = _saved(module)
            self._before[mid] = (weakref.ref(module), now)
        segment = _segment()
        if self._counted.setdefault(key, task) == task:
            self._starts.setdefault(key, []).append(now or _saved(module))
            if segment is not None:
                self._segments.setdefault(mid, set()).add(segment)
            return
        if mid not in self._pending:
            self._pending[mid] = (weakref.ref(module), now or _saved(module), task)
        n = self._calls.get((mid, task), 0)
        self._calls[(mid, task)] = n + 1
        starts = self._starts.get(key, [])
        if n < len(starts):
            _put_back(module, starts[n])
        if segment is not None and segment not in self._segments.get(mid, {segment}):
            self._probes[mid] = _saved(module)  # a segment plain backward also recomputes

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        """Refuse a recomputation in a segment the counted task did not recompute the module
        in (:meth:`_pre`'s probe) that changed its buffers: plain ``backward`` recomputes
        every segment once, each changing them, in its own order, which the passes (one per
        task) cannot keep. Buffers it leaves as they were (a constant table) pass."""
        saved = self._probes.pop(id(module), None)
        if saved is None or not _changed(saved):
            return
        raise RuntimeError(
            f"a module with buffers ({type(module).__name__}) changes them when recomputed in "
            f"two torch.utils.checkpoint segments that different tasks reach: plain backward "
            f"recomputes each segment once, each changing the buffers, and the balanced "
            f"step's passes (one per task) cannot keep that count and order. Call the module "
            f"in one checkpointed segment or outside them, give each segment its own module, "
            f"or use passes='batched' (one pass for every task; docs/loop.md, \"Inputs plain "
            f"PyTorch takes\")")

    def _flush(self, task: int | None) -> None:
        """The modules recomputed by graph tasks other than ``task`` (all: None) put back."""
        for mid, (ref, saved, owner) in list(self._pending.items()):
            if owner != task:
                del self._pending[mid]
                module = ref()
                if module is not None:
                    _put_back(module, saved)

    def _restore_all(self) -> None:
        """Every module recomputed during the guarded call as it was before the call."""
        self._pending = {}
        for ref, saved in self._before.values():
            module = ref()
            if module is not None:
                with contextlib.suppress(RuntimeError):  # an uncopied buffer: left as is
                    _put_back(module, saved)


def _changed(saved: Buffers) -> bool:
    """Whether some buffer of ``saved`` now differs from its saved value (its version
    counter, where it was not copied)."""
    for buffer, value, version in saved.values():
        if (value is not None and not torch.equal(buffer, value)) or (
                value is None and _version(buffer) != version):
            return True
    return False
