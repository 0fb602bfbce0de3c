"""Declared state: what :meth:`~gradbalance._module.StateModule.register_state` records, and
the checks it generates (docs/ARCHITECTURE.md, "Extension contract").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_COMPLEX = (torch.complex32, torch.complex64, torch.complex128)


@dataclass(frozen=True)
class StateSpec:
    """One declared state tensor.

    ``default``: a detached copy of the value at construction (None: unset until the first
    call); ``optional``: may be None, and is then absent from ``state_dict``; ``shape``: the
    shape a loaded optional value must have (None: any); ``task_dim``: the dimension with one
    entry per task (None: not per task); ``like_rows``: the shape of the task-gradient rows
    ``[K, P]`` (a rank's ``[K, P_local]`` columns on a sharded trunk); ``persistent``: saved in
    ``state_dict`` (a non-persistent one is only reset); ``finite``: a loaded floating value
    must hold no inf/NaN; ``pairwise``: one entry per task pair ``[..., K, K]`` (the last two
    dimensions, ``task_dim`` -1); ``dtype``: the dtype a loaded value takes (None: its own, a
    floating one: the rows' for ``like_rows``), an integer one's values at least 0 where the
    state is one number (a counter). A partial-labels mask slices every per-task
    dimension (:meth:`on_tasks`) and writes the step's result back into the active tasks' entries
    (:meth:`into_tasks`; docs/loop.md, "Partial labels").
    """

    default: Tensor | None
    optional: bool = False
    shape: tuple[int, ...] | None = None
    task_dim: int | None = None
    like_rows: bool = False
    persistent: bool = True
    finite: bool = True
    pairwise: bool = False
    dtype: torch.dtype | None = None

    def task_dims(self, value: Tensor) -> tuple[int, ...]:
        """The dimensions of ``value`` with one entry per task (non-negative; none: not per
        task)."""
        if self.task_dim is None:
            return ()
        dims = (-2, -1) if self.pairwise else (self.task_dim,)
        return tuple(d % value.dim() for d in dims)

    def on_tasks(self, value: Tensor, index: Tensor) -> Tensor:
        """A copy of ``value`` holding the tasks ``index`` only, along every per-task
        dimension."""
        dims, front, grid = self._grid(value, index)
        return value.movedim(dims, front)[grid].movedim(front, dims)

    def into_tasks(self, full: Tensor, part: Tensor, index: Tensor) -> Tensor:
        """A copy of ``full`` (as ``part``'s dtype and device) whose tasks ``index`` hold
        ``part`` (:meth:`on_tasks`'s shape); every other entry is ``full``'s."""
        out = full.to(device=part.device, dtype=part.dtype, copy=True)
        dims, front, grid = self._grid(out, index)
        out.movedim(dims, front)[grid] = part.movedim(dims, front)
        return out

    def _grid(self, value: Tensor, index: Tensor
              ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[Tensor, ...]]:
        dims = self.task_dims(value)
        idx = index.to(value.device)
        return dims, tuple(range(len(dims))), torch.meshgrid(*[idx] * len(dims), indexing="ij")

    def tasks_in(self, value: Tensor | None) -> int | None:
        """The number of tasks ``value`` holds (None: not per task, unset, or too few dims)."""
        if self.task_dim is None or value is None:
            return None
        return value.shape[self.task_dim] if value.dim() > self.task_dim >= -value.dim() else -1

    def initial(self, current: Tensor | None, home: torch.device | None) -> Tensor | None:
        """A fresh copy of the default, where the current value (else ``home``) lives."""
        if self.default is None:
            return None
        where = current.device if current is not None else home or self.default.device
        return self.default.to(device=where, copy=True)

    def call_error(self, owner: str, value: Tensor | None, k: int,
                   rows: Tensor | None) -> str | None:
        """Why ``value`` cannot go on with ``k`` tasks (and ``rows``), or None."""
        if value is None:
            return None
        if self.like_rows and rows is not None and value.shape != rows.shape:
            return (f"matrix has shape {tuple(rows.shape)} but {owner} tracks state of shape "
                    f"{tuple(value.shape)} from earlier calls; pass the same tasks and "
                    f"parameters every step, or call reset() first")
        if self.task_dim is not None and value.shape[self.task_dim] != k:
            return (f"got {k} tasks but {owner} tracks weights for "
                    f"{value.shape[self.task_dim]} tasks from earlier calls; pass the same "
                    f"tasks every step, or call reset() first")
        return None

    def load_error(self, owner: str, key: str, value: Tensor, current: Tensor | None,
                   num_tasks: int | None, rows: tuple[int, ...] | None) -> str | None:
        """Why a loaded ``value`` cannot replace ``current``, or None (``num_tasks``, ``rows``:
        the K and ``[K, P]`` shape the load keeps, ``StateModule._tracked_shapes``)."""
        where = f"{owner} state_dict[{key!r}]"
        return (self._dtype_error(where, value)
                or self._tasks_error(where, owner, value, num_tasks)
                or self._dims_error(where, value)
                or self._shape_error(where, owner, value, current, rows)
                or self._finite_error(where, value))

    def _dtype_error(self, where: str, value: Tensor) -> str | None:
        """A floating state loads a floating value, an integer one an integer value (not a
        bool), a counter (one integer) a value at least 0."""
        if self.dtype is None and not self.like_rows:
            return None  # not declared
        integer = self.dtype is not None and not self.dtype.is_floating_point
        ok = (value.dtype not in (torch.bool, *_COMPLEX)
              and value.is_floating_point() != integer)
        if not ok:
            expected = "an integer tensor" if integer else "a floating tensor"
            return (f"{where} has dtype {value.dtype} (expected {expected}); load the "
                    f"state_dict() the object saved")
        if integer and value.dim() == 0 and int(value) < 0:
            return (f"{where} is {int(value)}, a step counter below 0; load the state_dict() "
                    f"the object saved")
        return None

    def _dims_error(self, where: str, value: Tensor) -> str | None:
        """An optional state without a declared shape: ``[K, P]`` like the rows, ``[..., K,
        K]`` per task pair, ``[K]`` per task."""
        if not self.optional or self.shape is not None or self.task_dim is None:
            return None
        if self.like_rows:
            dims, text = value.dim() == 2, "[K, P], like the task-gradient rows"
        elif self.pairwise:  # square in its last two: the task count is read along dim -1
            dims = value.dim() >= 2 and value.shape[-2] == value.shape[-1]
            text = "[..., K, K], one entry per task pair"
        else:
            dims, text = value.dim() == 1, "[K], one entry per task"
        if dims:
            return None
        return f"{where} has shape {tuple(value.shape)} (expected {text})"

    def _tasks_error(self, where: str, owner: str, value: Tensor,
                     num_tasks: int | None) -> str | None:
        found = self.tasks_in(value)
        if found is None or num_tasks is None or found == num_tasks:
            return None
        return (f"{where} has shape {tuple(value.shape)}, not one entry per task along dim "
                f"{self.task_dim}: {owner} tracks num_tasks={num_tasks}; load a state saved "
                f"with the same number of tasks (or call reset() first to drop the tracked one)")

    def _shape_error(self, where: str, owner: str, value: Tensor, current: Tensor | None,
                     rows: tuple[int, ...] | None) -> str | None:
        shape = self.shape if self.optional else None if current is None else current.shape
        if self.like_rows and rows is not None:
            shape = rows
        if shape is None or tuple(value.shape) == tuple(shape):
            return None
        return (f"{where} has shape {tuple(value.shape)}, expected {tuple(shape)}; load a state "
                f"saved by a {owner} built with the same settings (number of tasks) and used "
                f"on the same parameters")

    def _finite_error(self, where: str, value: Tensor) -> str | None:
        if not self.finite or not (value.is_floating_point() or value.is_complex()):
            return None
        bad = int((~torch.isfinite(value)).sum())
        if not bad:
            return None
        return (f"{where} holds inf/NaN ({bad} of {value.numel()} entries); the state was "
                f"saved after a failed step or damaged: load an earlier checkpoint, or call "
                f"reset() instead")
