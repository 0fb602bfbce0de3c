"""Logging a balanced step to TensorBoard or CSV: ``loss/<k>`` (raw), ``size/<k>`` (true
gradient norm), ``w/<k>``, ``cos/<i>_<j>``, ``pre_clip``, ``pre_clip/<k>``, ``amp_skipped``
and, with :class:`RunningStats`, ``std/<tag>`` (docs/loop.md, "Logging"). TensorBoard is
optional (``pip install gradbalance[tensorboard]``).
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._checks import check_bool, check_int
from ._optional import require
from ._statedict import check_dict
from .stats import StepStats

__all__ = ["CSVLogger", "RunningStats", "log_stats", "stats_to_dict", "summary_writer",
           "task_labels"]


def task_labels(task_names: Sequence[str] | None, num_tasks: int) -> list[str]:
    """The names of the ``num_tasks`` tasks in the logged tags: ``task_names`` (checked: one
    distinct, non-empty name per task, without ``/``), or ``task0``, ``task1``, ...

    >>> task_labels(["depth", "normals"], 2), task_labels(None, 2)
    (['depth', 'normals'], ['task0', 'task1'])
    """
    if task_names is None:
        return [f"task{k}" for k in range(num_tasks)]
    if isinstance(task_names, str):
        raise TypeError(f"Invalid task_names: the string {task_names!r} (expected one name per "
                        f"task, e.g. ['depth', 'normals'])")
    names = list(task_names)
    bad = [n for n in names if not isinstance(n, str) or not n or "/" in n]
    if len(names) != num_tasks or bad or len(set(names)) != len(names):
        raise ValueError(
            f"Invalid task_names: {names} (expected {num_tasks} distinct non-empty strings "
            f"without '/', one per task{'; bad: ' + repr(bad) if bad else ''})"
        )
    return names


def _check_pre_clip(pre_clip: object) -> None:
    """None, a number or a one-number tensor (``ValueError`` naming ``pre_clip`` otherwise)."""
    if not (pre_clip is None or (isinstance(pre_clip, Tensor) and pre_clip.numel() == 1)
            or (isinstance(pre_clip, (int, float)) and not isinstance(pre_clip, bool))):
        shown = (f"a tensor of shape {tuple(pre_clip.shape)}" if isinstance(pre_clip, Tensor)
                 else repr(pre_clip))
        raise ValueError(f"Invalid pre_clip: {shown} (expected None or the global norm "
                         f"clip_grad_norm_ returned, one number)")


def _check_logged_step(stats: object, amp_skipped: object) -> None:
    """``stats`` a :class:`StepStats`, ``amp_skipped`` None, True or False (or a one-element
    tensor; a string was logged as a skipped step)."""
    if not isinstance(stats, StepStats):
        raise ValueError(f"Invalid stats: a {type(stats).__name__} (expected the StepStats "
                         f"that apply_ or balanced_backward returned)")
    if amp_skipped is not None and not isinstance(amp_skipped, bool) and not (
            isinstance(amp_skipped, Tensor) and amp_skipped.numel() == 1
            and not amp_skipped.is_complex()):
        raise ValueError(f"Invalid amp_skipped: {amp_skipped!r} (expected None, True or "
                         f"False)")


def _weights_of(stats: StepStats, weights: Tensor | None) -> Tensor | None:
    """The weights to log ``[K]`` (``weights``, else ``stats.weights``), still on their device."""
    w = stats.weights if weights is None else weights
    if w is None:
        return None
    if not isinstance(w, (Tensor, list, tuple)):
        raise ValueError(f"Invalid weights: a {type(w).__name__} (expected None or [K] task "
                         f"weights, e.g. a loss weighting's .weights)")
    w = torch.as_tensor(w).detach().reshape(-1)
    if w.device.type == "meta" or w.is_complex():
        raise ValueError(f"Invalid weights: a {w.device.type} tensor of dtype {w.dtype} "
                         f"(expected real numbers with values)")
    if w.numel() != stats.num_tasks:
        raise ValueError(
            f"weights has {w.numel()} entries but the step has {stats.num_tasks} tasks; pass "
            f"one weight per task"
        )
    return w


def _host_lists(parts: dict[str, Tensor]) -> dict[str, list[float]]:
    """Every tensor's entries as Python floats, one device→host transfer per device."""
    by_device: dict[torch.device, list[str]] = {}
    for name, tensor in parts.items():
        by_device.setdefault(tensor.device, []).append(name)
    out: dict[str, list[float]] = {}
    for names in by_device.values():
        flat = torch.cat([parts[n].detach().double().reshape(-1) for n in names]).tolist()
        at = 0
        for n in names:
            out[n], at = flat[at : at + parts[n].numel()], at + parts[n].numel()
    return out


def _tensors_to_log(stats: StepStats, pre_clip: float | Tensor | None,
                    weights: Tensor | None) -> dict[str, Tensor]:
    """The tensors behind the logged tags, by tag prefix (None fields left out)."""
    parts = {"loss": stats.losses, "size": stats.task_norms, "w": weights,
             "cos": stats.cosine, "pre_clip_tasks": stats.pre_clip_norms,
             "pre_clip": pre_clip.detach().reshape(()) if isinstance(pre_clip, Tensor) else None}
    return {name: tensor for name, tensor in parts.items() if tensor is not None}


def _task_tags(prefix: str, values: list[float] | None, names: list[str]) -> dict[str, float]:
    """``{prefix/<name>: value}`` for the ``K`` tasks (none without values)."""
    return {} if values is None else {f"{prefix}/{n}": values[t] for t, n in enumerate(names)}


def _per_task_tags(values: dict[str, list[float]], names: list[str]) -> dict[str, float]:
    """``loss``/``size``, ``w``, ``cos`` and per-task ``pre_clip`` tags, in the logged order."""
    out: dict[str, float] = {}
    k = len(names)
    for t, name in enumerate(names):
        out.update({f"{key}/{name}": values[key][t] for key in ("loss", "size") if key in values})
    out.update(_task_tags("w", values.get("w"), names))
    cos = values.get("cos")
    if cos is not None:
        out.update({f"cos/{names[i]}_{names[j]}": cos[i * k + j]
                    for i in range(k) for j in range(i + 1, k)})
    out.update(_task_tags("pre_clip", values.get("pre_clip_tasks"), names))
    return out


def stats_to_dict(
    stats: StepStats,
    pre_clip: float | Tensor | None = None,
    amp_skipped: bool | None = None,
    weights: Tensor | None = None,
    task_names: Sequence[str] | None = None,
) -> dict[str, float]:
    """The logged scalars of one step as ``{tag: float}`` (one transfer per device).

    Args:
        pre_clip: the global pre-clip norm (``clip_grad_norm_``'s return value), if any.
        amp_skipped: default ``stats.found_inf`` when the step used a scaler, else False.
        weights: task weights ``[K]`` (e.g. a loss weighting's); default ``stats.weights``.
        task_names: the tasks' names in the tags (``loss/depth``); default ``task0``, ...

    A per-sample step (``batch_dim=0``) is logged by its K summed tasks, ``stats.per_task``
    (docs/per_sample.md, "Statistics and logging").

    Example:
        >>> import torch
        >>> from gradbalance import StepStats, stats_to_dict
        >>> stats = StepStats(torch.tensor([0.5, 2.0]), torch.tensor([3.0, 4.0]), None, None, None)
        >>> stats_to_dict(stats, task_names=["depth", "seg"])
        {'loss/depth': 0.5, 'size/depth': 3.0, 'loss/seg': 2.0, 'size/seg': 4.0,
         'amp_skipped': 0.0}
    """
    _check_logged_step(stats, amp_skipped)
    stats = stats if stats.per_task is None else stats.per_task
    names = task_labels(task_names, stats.num_tasks)
    _check_pre_clip(pre_clip)
    values = _host_lists(_tensors_to_log(stats, pre_clip, _weights_of(stats, weights)))
    out = _per_task_tags(values, names)
    if pre_clip is not None:
        out["pre_clip"] = values["pre_clip"][0] if "pre_clip" in values else float(pre_clip)
    if amp_skipped is None:
        amp_skipped = stats.found_inf if stats.loss_scale_tensor is not None else False
    out["amp_skipped"] = 1.0 if amp_skipped else 0.0
    if stats.route is not None:  # mode="auto": 1 on a gramian-route step, 0 on a matrix one
        out["route/gramian"] = 1.0 if stats.route == "gramian" else 0.0
    return out


def summary_writer(log_dir: str | os.PathLike[str] | None = None, **kwargs: Any) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter``, with a clear error if tensorboard is missing.

    Example:
        >>> import tempfile
        >>> from gradbalance import summary_writer
        >>> with tempfile.TemporaryDirectory() as log_dir:
        ...     with summary_writer(log_dir) as writer:
        ...         writer.add_scalar("loss/task0", 0.5, 0)
        ...     print(type(writer).__name__, writer.get_logdir() == log_dir)
        SummaryWriter True
    """
    require("tensorboard", "tensorboard", "TensorBoard logging",
            "log with stats_to_dict / CSVLogger instead")
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=None if log_dir is None else str(log_dir), **kwargs)


def log_stats(
    writer: Any,
    stats: StepStats,
    step: int,
    pre_clip: float | Tensor | None = None,
    amp_skipped: bool | None = None,
    weights: Tensor | None = None,
    running: RunningStats | None = None,
    task_names: Sequence[str] | None = None,
) -> dict[str, float]:
    """Write :func:`stats_to_dict` (and ``running``'s ``std/<tag>``) with
    ``writer.add_scalar(tag, value, step)``, or as one row of a :class:`CSVLogger` (its
    ``task_names`` unless given); returns what was written.

    Example:
        >>> import torch
        >>> from gradbalance import StepStats, log_stats
        >>> class Printer:  # stands in for a SummaryWriter
        ...     def add_scalar(self, tag, value, step): print(step, tag, value)
        >>> _ = log_stats(Printer(), StepStats(torch.tensor([0.5]), None, None, None, None), 7)
        7 loss/task0 0.5
        7 amp_skipped 0.0
    """
    check_int("step", step, 0, ", the training step")
    csv = isinstance(writer, CSVLogger)
    if not (csv or hasattr(writer, "add_scalar")):
        raise ValueError(
            f"writer is a {type(writer).__name__} without add_scalar; pass a "
            f"torch.utils.tensorboard.SummaryWriter (gradbalance.summary_writer(log_dir)) or "
            f"a gradbalance.CSVLogger"
        )
    if csv and task_names is None:
        task_names = writer.task_names
    scalars = stats_to_dict(stats, pre_clip=pre_clip, amp_skipped=amp_skipped, weights=weights,
                            task_names=task_names)
    before = None if running is None else running.state_dict()
    try:  # a writer that refuses the row leaves the window as it was
        if running is not None:
            scalars.update(running.update(scalars))
        if csv:
            writer.log(scalars, step)
            return scalars
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, step)
    except BaseException:
        if running is not None and before is not None:
            running.load_state_dict(before)
        raise
    return scalars


def _numbers(name: str, scalars: object) -> dict[str, float]:
    """``scalars`` (a mapping of tags to numbers or 0-d tensors) as floats, all converted
    first; ``ValueError`` naming the tag otherwise."""
    if not isinstance(scalars, Mapping):
        raise ValueError(f"Invalid {name}: a {type(scalars).__name__} (expected a mapping of "
                         f"tags to numbers, e.g. gradbalance.stats_to_dict(stats))")
    out: dict[str, float] = {}
    for tag, value in scalars.items():
        try:
            out[str(tag)] = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"Invalid {name}[{tag!r}]: {value!r} (expected a number); nothing "
                             f"was recorded") from None
    return out


def _population_std(values: list[float]) -> float:
    """The population standard deviation of ``values`` (exactly rounded sums)."""
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


class RunningStats:
    """Sliding-window population standard deviation of every logged scalar: ``std/<tag>``
    (finite values only; 0 after one value, NaN before any, so CSV columns are stable from the
    first step).

    Example:
        >>> from gradbalance import RunningStats
        >>> running = RunningStats(window=2)
        >>> [running.update({"loss/task0": v}) for v in (1.0, 3.0, 7.0)]  # std of 1, {1, 3}, {3, 7}
        [{'std/loss/task0': 0.0}, {'std/loss/task0': 1.0}, {'std/loss/task0': 2.0}]
    """

    def __init__(self, window: int = 100) -> None:
        self.window = check_int("window", window, 2, ", e.g. 100")
        self.reset()

    def reset(self) -> None:
        self._values: dict[str, list[float]] = {}

    def update(self, scalars: Mapping[str, float]) -> dict[str, float]:
        """Add one step's scalars (every value converted before any is added: a value that
        is not a number raises ``ValueError`` and nothing moves); their ``std/<tag>``."""
        values = _numbers("scalars", scalars)
        for tag, value in values.items():
            if tag != "amp_skipped" and not tag.startswith("std/"):
                self._append(tag, value)
        tracked = [tag for tag in values if tag != "amp_skipped" and not tag.startswith("std/")]
        return {f"std/{tag}": _population_std(self._values[tag]) if self._values.get(tag)
                else math.nan for tag in tracked}

    def _append(self, tag: str, value: float) -> None:
        if not math.isfinite(value):
            return
        values = self._values.setdefault(tag, [])
        values.append(value)
        del values[: max(0, len(values) - self.window)]

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window, "values": {k: list(v) for k, v in self._values.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; ``ValueError``, nothing changed, for a window of
        another size or values that are not finite numbers, at most ``window`` per tag."""
        check_dict("RunningStats", state_dict)
        if "values" not in state_dict:
            raise ValueError("state_dict lacks 'values'; pass RunningStats.state_dict() output")
        if state_dict.get("window", self.window) != self.window:
            raise ValueError(
                f"state_dict was saved with window={state_dict['window']} but this RunningStats "
                f"has window={self.window}; build it with the saved window"
            )
        saved = state_dict["values"]
        if not isinstance(saved, Mapping):
            raise ValueError(f"state_dict['values'] must map tags to lists of numbers, got "
                             f"{type(saved).__name__}; pass RunningStats.state_dict() output")
        try:
            values = {str(k): [float(x) for x in _number_list(v)] for k, v in saved.items()}
        except (TypeError, ValueError) as error:
            raise ValueError(f"state_dict['values'] holds a value that is not a list of "
                             f"numbers ({error}); pass RunningStats.state_dict() output") from None
        for tag, kept in values.items():
            if len(kept) > self.window or not all(math.isfinite(x) for x in kept):
                raise ValueError(f"state_dict['values'][{tag!r}] holds {len(kept)} values "
                                 f"(expected at most window={self.window} finite numbers, as "
                                 f"update() keeps them); pass RunningStats.state_dict() output")
        self._values = values


def _number_list(value: Any) -> Sequence[Any]:
    """A saved window: a list or tuple (a string is not a list of numbers)."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"a {type(value).__name__}, not a list")
    return value


def _header_of(path: str) -> list[str] | None:
    """The tags of an existing CSV log at ``path`` (its header after ``step``), None for no
    file or an empty one."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return None
    with open(path, newline="") as file:
        header = next(csv.reader(file), [])
    if not header or header[0] != "step":
        raise ValueError(f"Invalid path: {path!r} is not a CSVLogger log (its first column is "
                         f"{header[:1]}, not 'step'); append to a log CSVLogger wrote, or pass "
                         f"append=False to replace it")
    return header[1:]


class CSVLogger:
    """Appends one row per step to a CSV file: ``step`` then every tag, in first-seen order;
    the first row fixes the columns (a new tag later raises, a missing one is empty). A new
    logger replaces a file at ``path``; ``append=True`` continues it (a resumed run: its
    header fixes the columns). Values are numbers (0-d tensors converted), checked before
    anything is written.

    Example:
        >>> import pathlib, tempfile
        >>> from gradbalance import CSVLogger
        >>> with tempfile.TemporaryDirectory() as d:
        ...     with CSVLogger(pathlib.Path(d, "run.csv")) as log:
        ...         log.log({"loss/task0": 0.5, "update_norm": 2.0}, step=0)
        ...     print(pathlib.Path(d, "run.csv").read_text())
        step,loss/task0,update_norm
        0,0.5,2.0
        <BLANKLINE>
    """

    def __init__(self, path: str | os.PathLike[str],
                 task_names: Sequence[str] | None = None, *, append: bool = False) -> None:
        self.task_names = None if task_names is None else task_labels(
            task_names, len(task_names) if not isinstance(task_names, str) else 0)
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            raise ValueError(f"CSVLogger: {self.path!r} is a directory; pass a file path in it, "
                             f"e.g. CSVLogger(os.path.join({self.path!r}, 'run.csv'))")
        self._columns: list[str] | None = (_header_of(self.path)
                                           if check_bool("append", append) else None)
        self._file = open(self.path, "a" if append else "w", newline="")  # noqa: SIM115
        self._writer = csv.writer(self._file)  # the file: closed in close()

    def log(self, scalars: Mapping[str, float], step: int) -> None:
        """One row: ``step`` (an int >= 0) and the numbers of ``scalars``."""
        if self._file.closed:
            raise ValueError(f"CSVLogger({self.path!r}) is closed; open a new one "
                             f"(append=True continues the file)")
        values = _numbers("scalars", scalars)
        check_int("step", step, 0)
        if "step" in values:
            raise ValueError("Invalid scalars: the tag 'step' is the first column's; rename it")
        if self._columns is None and not values:
            raise ValueError("Invalid scalars: the first row is empty, and it fixes the "
                             "columns; log at least one tag")
        extra = [tag for tag in values if self._columns is not None and tag not in self._columns]
        if extra:
            raise ValueError(
                f"tags {extra} were not in the first row; log the same tags every step (the "
                f"CSV columns are fixed by the first row)"
            )
        if self._columns is None:
            self._columns = list(values)
            self._writer.writerow(["step", *self._columns])
        self._writer.writerow([step, *(values.get(c, "") for c in self._columns)])
        self._file.flush()

    def log_stats(self, stats: StepStats, step: int, **kwargs: Any) -> dict[str, float]:
        """``stats_to_dict(stats, **kwargs)`` written as one row; returns the dict."""
        kwargs.setdefault("task_names", self.task_names)
        scalars = stats_to_dict(stats, **kwargs)
        self.log(scalars, step)
        return scalars

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> CSVLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
