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
later one they are put back after its forward. When the guarded call
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
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RecomputeGuard", "passes_on"]

#: ``(buffer, its value)`` pairs of one module, by buffer name.
Buffers = dict[str, tuple[Tensor, Tensor]]


def _saved(module: nn.Module) -> Buffers:
    """The module's own buffers and a copy of each value."""
    return {name: (b, b.detach().clone()) for name, b in module._buffers.items()
            if b is not None}


def _put_back(module: nn.Module, saved: Buffers) -> None:
    """Each buffer the same tensor as before, with its value then."""
    with torch.no_grad():
        for name, (buffer, value) in saved.items():
            buffer.copy_(value)
            if module._buffers.get(name) is not buffer:
                module._buffers[name] = buffer


def _graph_task() -> int:
    """The running backward's graph task, -1 outside a backward."""
    return int(torch._C._current_graph_task_id())


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
    the first graph task that recomputes a module for a graph keeps its changes.
    :meth:`later` guards a later backward through the last call's graph (``apply_``'s
    write-back). :func:`passes_on` names another graph for the passes inside it.
    """

    def __init__(self) -> None:
        self.graph = -1  # the graph the passes now run through
        self._first: dict[tuple[int, int], int] = {}  # (module, graph) → the counted task
        self._before: dict[int, tuple[weakref.ref[nn.Module], Buffers]] = {}
        # modules inside an uncounted recomputation's forward, to put back after it
        self._pending: dict[int, tuple[weakref.ref[nn.Module], Buffers]] = {}

    @contextlib.contextmanager
    def call(self, graph: int, first: bool) -> Iterator[None]:
        """One call of the step through the micro-batch graph ``graph``."""
        if first:
            self._first = {}
        self.graph = graph
        with self.later():
            yield

    @contextlib.contextmanager
    def later(self) -> Iterator[None]:
        """A backward through the graph of the last :meth:`call`."""
        self._before, self._pending = {}, {}
        stack = _active()
        stack.append(self)
        pre = nn.modules.module.register_module_forward_pre_hook(self._pre)
        post = nn.modules.module.register_module_forward_hook(self._post)
        try:
            yield
            self._put_back_pending()
        except BaseException:
            self._restore_all()
            raise
        finally:
            pre.remove()
            post.remove()
            stack.pop()
            self._before, self._pending = {}, {}

    def _pre(self, module: nn.Module, args: Any) -> None:
        task = _graph_task()
        if task < 0 or not module._buffers:
            return
        key = id(module)
        if key not in self._before:
            self._before[key] = (weakref.ref(module), _saved(module))
        if self._first.setdefault((key, self.graph), task) != task and key not in self._pending:
            self._pending[key] = (weakref.ref(module), _saved(module))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        pending = self._pending.pop(id(module), None)
        if pending is not None:
            _put_back(module, pending[1])

    def _put_back_pending(self) -> None:
        """The modules whose forward a recomputation left without its forward hook: torch
        stops a recomputation inside the op that saves its last needed tensor (early stop),
        after a ``BatchNorm`` there updated its statistics."""
        for ref, saved in self._pending.values():
            module = ref()
            if module is not None:
                _put_back(module, saved)
        self._pending = {}

    def _restore_all(self) -> None:
        """Every module recomputed during the guarded call as it was before the call."""
        for ref, saved in self._before.values():
            module = ref()
            if module is not None:
                _put_back(module, saved)
