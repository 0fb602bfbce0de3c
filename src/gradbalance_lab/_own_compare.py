"""``compare`` on the user's own model and data: the table and outputs of ``gradbalance
compare``, for any model whose forward returns its K task losses (docs/compare.md, "Your own
model")."""

from __future__ import annotations

import math
import numbers
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from gradbalance_lab._cli_common import commit_out, prepare_out, remove_run_logs
from gradbalance_lab._extras import Extra, missing_extras, missing_message
from gradbalance_lab._mtl_methods import (
    DEFAULT_BALANCERS,
    DEFAULT_WEIGHTINGS,
    PLAIN,
    Method,
    available_weightings,
    resolve_names,
)
from gradbalance_lab._mtl_outputs import Tasks, write_report
from gradbalance_lab._mtl_report import Summary, format_markdown, summarize
from gradbalance_lab._mtl_runner import RunResult
from gradbalance_lab._mtl_step import MethodStep
from gradbalance_lab._mtl_timing import STEP_ERRORS, StepTime, time_interleaved
from gradbalance_lab._out_folder import OutFolder
from gradbalance_lab._own_model import (
    OwnProblem,
    make_weighting,
    metrics,
    own_run,
    own_step_timer,
    task_losses,
)
from gradbalance_lab._signals import shielded

__all__ = ["Comparison", "ComparisonInterrupted", "compare", "compare_methods",
           "default_methods"]

#: What ``compare`` writes into ``out`` (the outputs of ``gradbalance compare``).
OUTPUTS = ("summary.md", "summary.csv", "runs.csv", "history.csv", "config.json",
           "compare.png", "tb")


def default_methods() -> list[str]:
    """The methods ``gradbalance compare`` runs by default (those installed)."""
    return [*DEFAULT_BALANCERS, *(w for w in DEFAULT_WEIGHTINGS if w in available_weightings())]


@dataclass(frozen=True)
class Comparison:
    """What :func:`compare` returns: one :class:`Summary` row per method (``rows``, the plain
    step first), the markdown ``table`` (``str()`` of the object), every run, and the folder
    the outputs were written to (None without ``out``)."""

    rows: list[Summary]
    table: str
    runs: list[RunResult]
    out: Path | None

    def __str__(self) -> str:
        return self.table

    def row(self, label: str) -> Summary:
        """The row of method ``label`` (e.g. ``"plain"``, ``"mgda"``)."""
        for row in self.rows:
            if row.label == label:
                return row
        raise KeyError(f"no row {label!r}; the rows: {[r.label for r in self.rows]}")


class ComparisonInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM) stopped :func:`compare`: ``comparison`` holds the runs that
    finished and ``comparison.out`` the folder their outputs were written to (with ``out``:
    ``out`` itself, or where an ``overwrite`` run wrote aside, the earlier outputs kept in
    ``final``); ``done`` says ``k of N runs finished``."""

    def __init__(self, comparison: Comparison, done: str, final: Path | None) -> None:
        super().__init__(f"interrupted: {done}")
        self.comparison, self.done, self.final = comparison, done, final


def _count(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise ValueError(f"Invalid {name}: {value!r} (expected an int >= {low})")
    return int(value)


def _seeds(seeds: int | Sequence[int]) -> list[int]:
    if isinstance(seeds, numbers.Integral) and not isinstance(seeds, bool):
        return list(range(_count("seeds", seeds, 1)))
    if not isinstance(seeds, Sequence) or not seeds:
        raise ValueError(f"Invalid seeds: {seeds!r} (expected a number of seeds >= 1 or a "
                         "non-empty list of ints)")
    return [_count("seeds entry", s, 0) for s in seeds]


def _callable(name: str, value: Any, expected: str) -> None:
    if not callable(value):
        raise TypeError(f"Invalid {name}: a {type(value).__name__} (expected {expected})")


def _tasks(num_tasks: int, task_names: Sequence[str] | None, evaluate: Any,
           higher_is_better: bool | Sequence[bool]) -> Tasks:
    names = tuple(f"task{k}" for k in range(num_tasks)) if task_names is None \
        else tuple(str(n) for n in task_names)
    if len(names) != num_tasks or len(set(names)) != num_tasks:
        raise ValueError(f"Invalid task_names: {list(names)} (expected {num_tasks} different "
                         "names, one per loss the model returns)")
    if evaluate is None:
        return Tasks(names, tuple(f"{n}_loss" for n in names), (False,) * num_tasks)
    hib = ((bool(higher_is_better),) * num_tasks if isinstance(higher_is_better, bool)
           else tuple(bool(h) for h in higher_is_better))
    if len(hib) != num_tasks:
        raise ValueError(f"Invalid higher_is_better: {len(hib)} entries (expected one per "
                         f"task, {num_tasks}, or one bool)")
    return Tasks(names, names, hib)


def _check_methods(problem: OwnProblem, methods: list[Method]) -> list[Method]:
    """Build every method once on the seed-0 model: the ones that can run. A method that
    cannot raises here, or, chosen by default or by ``all`` (``optional``), is skipped with a
    warning (a balancer for at least 3 tasks on a 2-task model)."""
    model, shared, heads = problem.model(0)
    usable = []
    for method in methods:
        try:
            MethodStep(method, shared, heads, problem.num_tasks, 0,
                       lambda key: make_weighting(problem, model, key, 0))
        except (ValueError, TypeError) as error:
            if not method.optional:
                raise ValueError(f"Invalid methods: {method.key!r} cannot run on this model: "
                                 f"{error}") from None
            warnings.warn(f"skipped {method.kind} {method.key!r}: {error}", RuntimeWarning,
                          stacklevel=4)
            continue
        usable.append(method)
    return usable


def _run_all(problem: OwnProblem, methods: list[Method], seeds: list[int],
             tb: Path | None, verbose: bool) -> tuple[list[RunResult], bool]:
    """The runs in order; the finished ones and whether Ctrl-C stopped the loop (the
    TensorBoard folder of the run it cut short is removed)."""
    results = []
    running: Path | None = None
    try:
        for seed in seeds:
            for method in methods:
                running = None if tb is None else tb / method.label / f"seed{seed}"
                try:
                    results.append(own_run(problem, method, seed, running))
                except STEP_ERRORS as error:  # a solver failing fails this run only
                    results.append(RunResult(method, seed, [math.nan] * problem.num_tasks,
                                             error=f"{type(error).__name__}: {error}"))
                running = None
                if verbose:
                    print(f"compare: {method.label} seed {seed} done", file=sys.stderr,
                          flush=True)
    except KeyboardInterrupt:
        if running is not None:
            remove_run_logs(running)
        return results, True
    return results, False


def compare(
    build_model: Callable[[], nn.Module],
    make_batches: Callable[[int], Iterable[Any]],
    *,
    methods: Sequence[str] | None = None,
    steps: int = 200,
    seeds: int | Sequence[int] = 3,
    shared: str | Callable[[nn.Module], Iterable[Tensor]] = "trunk",
    evaluate: Callable[[nn.Module], Sequence[float]] | None = None,
    higher_is_better: bool | Sequence[bool] = True,
    task_names: Sequence[str] | None = None,
    optimizer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None,
    timing_rounds: int = 20,
    out: str | Path | None = None,
    overwrite: bool = False,
    plot: bool = True,
    tensorboard: bool = False,
    verbose: bool = False,
) -> Comparison:
    """Train every method on your own model over ``seeds`` and compare metrics and step cost.

    For each seed and method (the plain step ``losses.sum().backward()`` always first, then
    ``methods``: balancer and loss-weighting names, default those of ``gradbalance compare``)
    a fresh ``build_model()`` (after ``torch.manual_seed(seed)``) trains ``steps`` steps on
    ``make_batches(seed)``: forward, the method's backward, ``optimizer.step()``,
    ``zero_grad``. ``model(batch)`` returns the K task losses; ``shared`` is the attribute
    holding the shared trunk (or a callable ``model -> parameters``); every other trainable
    parameter is a head's. The step times are measured interleaved over methods and seeds
    (``timing_rounds`` rounds after 3 warm-up rounds; 0 for none) and shown as ``× plain
    step``. The metric is ``evaluate(model)`` (one value per task; ``higher_is_better``), or
    without it each task's mean training loss over the last tenth of the steps (lower is
    better). With ``out`` the outputs of ``gradbalance compare`` are written there
    (``summary.md``, ``summary.csv``, ``runs.csv``, ``history.csv``, ``config.json``,
    ``compare.png`` with ``plot`` and matplotlib, ``tb/`` with ``tensorboard``); a folder
    holding files needs ``overwrite=True``. The optimizer defaults to Adam, lr 1e-3. torch's
    global random state is as before the call (each run seeds it).

    Example, two regression tasks on a small GRU (docs/compare.md, "Your own model")::

        >>> import torch
        >>> from torch import nn
        >>> from gradbalance_lab.compare import compare
        >>> class Net(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.trunk = nn.GRU(3, 8, batch_first=True)
        ...         self.heads = nn.ModuleList(nn.Linear(8, 1) for _ in range(2))
        ...     def forward(self, batch):
        ...         x, y = batch
        ...         feats = self.trunk(x)[0][:, -1]
        ...         return torch.stack([nn.functional.mse_loss(h(feats).squeeze(-1), y[:, k])
        ...                             for k, h in enumerate(self.heads)])
        >>> def batches(seed):
        ...     g = torch.Generator().manual_seed(seed)
        ...     x = torch.randn(64, 5, 3, generator=g)
        ...     y = torch.stack([x.sum((1, 2)), 1e-3 * x[:, -1, 0]], 1)
        ...     return [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
        >>> result = compare(Net, batches, methods=["mgda", "imtlg"], steps=8, seeds=2,
        ...                  task_names=["sum", "last"], timing_rounds=2)
        >>> [row.label for row in result.rows]
        ['plain', 'mgda', 'imtlg']
        >>> result.row("plain").time_ratio
        1.0
    """
    chosen = resolve_names(default_methods() if methods is None else methods)
    return compare_methods(build_model, make_batches, chosen, steps=steps, seeds=seeds,
                           shared=shared, evaluate=evaluate, higher_is_better=higher_is_better,
                           task_names=task_names, optimizer=optimizer,
                           timing_rounds=timing_rounds, out=out, overwrite=overwrite,
                           plot=plot, tensorboard=tensorboard, verbose=verbose)


def compare_methods(build_model: Callable[[], nn.Module],
                    make_batches: Callable[[int], Iterable[Any]], chosen: list[Method],
                    **options: Any) -> Comparison:
    """:func:`compare` of the resolved ``chosen`` methods (``gradbalance compare --model``:
    the ``optional`` ones, from the defaults or ``all``, skipped with a warning where they
    cannot run); ``options``: :func:`compare`'s other keyword arguments."""
    _callable("build_model", build_model, "a callable returning the model")
    _callable("make_batches", make_batches, "a callable seed -> iterable of batches")
    chosen = [PLAIN, *(method for method in chosen if method != PLAIN)]  # the plain step first
    with torch.random.fork_rng(devices=[]):  # every run seeds torch: the caller's RNG is kept
        return _compare(build_model, make_batches, chosen, **options)


def _compare(build_model: Callable[[], nn.Module], make_batches: Callable[[int], Iterable[Any]],
             chosen: list[Method], *, steps: int = 200, seeds: int | Sequence[int] = 3,
             shared: str | Callable[[nn.Module], Iterable[Tensor]] = "trunk",
             evaluate: Callable[[nn.Module], Sequence[float]] | None = None,
             higher_is_better: bool | Sequence[bool] = True,
             task_names: Sequence[str] | None = None,
             optimizer: Callable[[list[Tensor]], torch.optim.Optimizer] | None = None,
             timing_rounds: int = 20, out: str | Path | None = None, overwrite: bool = False,
             plot: bool = True, tensorboard: bool = False, verbose: bool = False,
             log_every: int = 10) -> Comparison:
    """:func:`compare` once its callables are checked, inside a forked torch RNG (the
    defaults: :func:`compare`'s)."""
    problem = OwnProblem(build_model, make_batches, shared, _count("steps", steps, 1),
                         optimizer or (lambda params: torch.optim.Adam(params, lr=1e-3)),
                         evaluate, 0, _count("log_every", log_every, 1))
    seed_list = _seeds(seeds)
    rounds = _count("timing_rounds", timing_rounds, 0)
    model, _, _ = problem.model(seed_list[0])
    num_tasks = task_losses(model, next(problem.batches(seed_list[0]))).numel()
    problem = OwnProblem(build_model, make_batches, shared, problem.steps, problem.optimizer,
                         evaluate, num_tasks, problem.log_every)
    tasks = _tasks(num_tasks, task_names, evaluate, higher_is_better)
    if evaluate is not None:
        _callable("evaluate", evaluate, "a callable model -> one metric per task")
        metrics(problem, model, [])  # a wrong count fails here, before any training
    chosen = _check_methods(problem, chosen)
    if out is not None:
        _check_extras(plot, tensorboard)
    folder = None if out is None else prepare_out(Path(out), overwrite=overwrite,
                                                  outputs=OUTPUTS, option="out")
    try:
        timings = _timings(problem, chosen, seed_list, rounds)
        results, interrupted = ([], True) if timings is None else _run_all(
            problem, chosen, seed_list,
            None if folder is None or not tensorboard else folder.work / "tb", verbose)
        done = f"{len(results)} of {len(chosen) * len(seed_list)} runs finished"
        title = "gradbalance_lab.compare" + (f" (interrupted: {done})" if interrupted else "")
        with shielded():
            config = {"methods": [m.label for m in chosen], "steps": steps,
                      "seeds": seed_list, "task_names": list(tasks.task_names),
                      "timing_rounds": rounds,
                      "model": getattr(build_model, "__qualname__", repr(build_model))}
            comparison = _outputs(folder, results, timings or {}, tasks, title, config,
                                  plot=plot, tensorboard=tensorboard)
            if folder is not None and not interrupted:
                commit_out(folder, option="out")
                return Comparison(comparison.rows, comparison.table, results, folder.final)
    except BaseException:
        if folder is not None:
            folder.discard()  # the out folder as it was
        raise
    if not interrupted:
        return comparison
    raise ComparisonInterrupted(comparison, done, None if folder is None else folder.final)


def _outputs(folder: OutFolder | None, results: list[RunResult],
             timings: dict[str, StepTime], tasks: Tasks, title: str, config: dict[str, Any],
             plot: bool, tensorboard: bool) -> Comparison:
    """The table of ``results``, and with ``folder`` the outputs written into its work
    folder."""
    if folder is None:
        rows = summarize(results, tasks.higher_is_better, timings)
        table = format_markdown(rows, tasks.metric_names, tasks.higher_is_better)
        return Comparison(rows, table, results, None)
    written = write_report(folder.work, results, timings, tasks, config, title=title,
                           plot="compare.png" if plot else None, tensorboard=tensorboard)
    return Comparison(written.summaries, written.table, results, folder.work)


def _timings(problem: OwnProblem, methods: list[Method], seeds: list[int],
             rounds: int) -> dict[str, StepTime] | None:
    """The interleaved step times (``{}`` for no rounds); None when Ctrl-C stopped them."""
    if rounds == 0:
        return {}
    by_label = {m.label: m for m in methods}
    try:
        return time_interleaved(
            lambda label, seed: own_step_timer(problem, by_label[label], seed),
            list(by_label), seeds, reference=PLAIN.label, rounds=rounds)
    except KeyboardInterrupt:
        return None


def _check_extras(plot: bool, tensorboard: bool) -> None:
    wanted = [Extra("matplotlib", "plot", "the plot", "pass plot=False")] if plot else []
    if tensorboard:
        wanted.append(Extra("tensorboard", "tensorboard", "TensorBoard logs",
                            "pass tensorboard=False"))
    missing = missing_extras(wanted)
    if missing:
        raise ImportError(missing_message(missing))
