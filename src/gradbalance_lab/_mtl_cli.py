"""Options and orchestration shared by ``gradbalance compare`` and ``gradbalance train``."""

from __future__ import annotations

import argparse
import math
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

from gradbalance_lab._cli_common import (
    MAX_THREADS,
    OVERWRITE_HELP,
    OutputError,
    check_out,
    commit_out,
    int_at_least,
    prepare_out,
    remove_run_logs,
)
from gradbalance_lab._extras import Extra, missing_extras, missing_message
from gradbalance_lab._mtl_methods import PLAIN, Method
from gradbalance_lab._mtl_outputs import Tasks, Written, write_report
from gradbalance_lab._mtl_progress import Progress
from gradbalance_lab._mtl_runner import (
    RunConfig,
    RunResult,
    build_model,
    check_method,
    step_timer,
    train_run,
)
from gradbalance_lab._mtl_timing import StepTime, time_interleaved
from gradbalance_lab._out_folder import OutFolder
from gradbalance_lab._signals import shielded
from gradbalance_lab.data import MultiDigits, make_multidigits

__all__ = ["MAX_DEPTH", "MAX_SEEDS", "OUTPUTS", "add_common_options",
           "config_from_args", "data_from_args", "execute"]

#: Bounds of the integer options that are not sizes of a tensor (those are bounded by memory:
#: a data set or a model that cannot be allocated is a one-line error naming the options).
MAX_SEEDS = 100_000
MAX_DEPTH = 1_000

#: What ``compare`` and ``train`` write into ``--out`` (``--overwrite`` replaces these).
OUTPUTS = ("summary.md", "summary.csv", "runs.csv", "history.csv", "config.json",
           "compare.png", "train.png", "tb")


def _finite_float(allow_zero: bool) -> Callable[[str], float]:
    """Parser of a finite number ``> 0`` (or ``>= 0`` with ``allow_zero``)."""
    bound = ">= 0" if allow_zero else "> 0"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid number: {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(
                f"invalid value: {text} (expected a finite number {bound})")
        return value
    return parse


_T = TypeVar("_T")

_positive_float = _finite_float(allow_zero=False)
_non_negative_float = _finite_float(allow_zero=True)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: …)`` except for flags and options whose help already explains it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help or ""
        return super()._get_help_string(action) or ""


def add_common_options(parser: argparse.ArgumentParser, *, seeds: int, out: str,
                       epochs: int = 10) -> None:
    """Data, training and output options (every one documented in ``--help``)."""
    parser.formatter_class = _DefaultsFormatter
    parser.epilog = ("Ctrl-C (or SIGTERM) stops the command after it writes the outputs of the "
                     "runs that finished (exit code 130; 143 for SIGTERM); with --overwrite "
                     "they go to the <out>.incomplete-* folder and the earlier outputs are "
                     "kept. A usage error (a bad value, an unusable --out, too large a size) "
                     "is one line on stderr, exit code 2, before any training.")
    data = parser.add_argument_group("data (MultiDigits, built from scikit-learn's digits)")
    data.add_argument("--variant", choices=("plain", "scaled"), default="plain",
                      help="'scaled' multiplies the right-digit task's loss by --right-scale "
                           "(the loss-scale problem)")
    data.add_argument("--right-scale", type=_positive_float, default=1e-3,
                      help="loss factor of the right task in the scaled variant")
    data.add_argument("--regression", action="store_true",
                      help="add a third task: regress the sum of the two digits (metric: MAE)")
    data.add_argument("--n-train", type=int_at_least(1), default=6000,
                      help="training canvases (drawn from the training pool of images)")
    data.add_argument("--n-test", type=int_at_least(1), default=2000,
                      help="test canvases (drawn from the disjoint test pool of images)")
    data.add_argument("--data-seed", type=int_at_least(0, 2**64 - 1), default=0,
                      help="seed of the dataset build (pools, pairs, offsets), 0 to 2**64-1")
    train = parser.add_argument_group("training")
    train.add_argument("--seeds", type=int_at_least(1, MAX_SEEDS), default=seeds,
                       help="number of seeds per method (seeds 0..N-1: initialisation, "
                            f"batch order, the balancers' random draws; at most {MAX_SEEDS})")
    train.add_argument("--epochs", type=int_at_least(1), default=epochs,
                       help="passes over the training canvases")
    train.add_argument("--batch-size", type=int_at_least(1), default=128, help="batch size")
    train.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                       help="optimizer of every run (sgd: momentum 0.9)")
    train.add_argument("--lr", type=_positive_float, default=1e-3, help="learning rate")
    train.add_argument("--weight-decay", type=_non_negative_float, default=0.0,
                       help="optimizer weight decay (coupled L2 for adam)")
    train.add_argument("--trunk", choices=("mlp", "cnn"), default="mlp",
                       help="shared trunk: MLP on the flattened canvas or a small CNN")
    train.add_argument("--hidden", type=int_at_least(2), default=64,
                       help="trunk width (MLP units; CNN: 2× the first conv's channels)")
    train.add_argument("--depth", type=int_at_least(1, MAX_DEPTH), default=2,
                       help=f"MLP layers (at most {MAX_DEPTH})")
    train.add_argument("--max-norm", type=_positive_float, default=None,
                       help="global clip_grad_norm_ after the balanced backward (off by default)")
    train.add_argument("--per-sample-clip", type=_positive_float, default=None, metavar="C",
                       help="DP-SGD: clip every (sample, task) gradient to norm C before the "
                            "batch mean (ghost norms; off by default)")
    train.add_argument("--noise", type=_non_negative_float, default=0.0, metavar="SIGMA",
                       help="DP-SGD noise multiplier: N(0, (SIGMA*C/B)^2) on the update "
                            "(needs --per-sample-clip)")
    train.add_argument("--timing-rounds", type=int_at_least(0, MAX_SEEDS), default=20,
                       help="rounds of the interleaved step timing (one step of every method "
                            "and seed per round, after 3 warm-up rounds); 0: each run's own "
                            "median step time instead")
    train.add_argument("--threads", type=int_at_least(1, MAX_THREADS), default=1,
                       help=f"torch CPU threads (1 keeps step times comparable; at most "
                            f"{MAX_THREADS})")
    outs = parser.add_argument_group("outputs")
    outs.add_argument("--out", type=Path, default=Path(out),
                      help="output folder: tables (CSV, markdown), plot, TensorBoard logs; a "
                           "folder that already holds files is refused unless --overwrite "
                           f"(default: {out})")
    outs.add_argument("--overwrite", action="store_true",
                      help=OVERWRITE_HELP.format(names=", ".join(OUTPUTS[:-1]) + ", tb/"))
    outs.add_argument("--log-every", type=int_at_least(1), default=10,
                      help="TensorBoard: write the step statistics every N steps")
    outs.add_argument("--no-tensorboard", action="store_true", help="write no TensorBoard logs")
    outs.add_argument("--no-plot", action="store_true", help="write no PNG plot")
    outs.add_argument("--no-progress", action="store_true",
                      help="no progress bar even on a terminal: plain lines instead, one per "
                           "finished run and one every 30 s (always so when not a terminal)")
    outs.add_argument("--quiet", action="store_true", help="print only the final table")


def data_from_args(args: argparse.Namespace) -> MultiDigits:
    scale = args.right_scale if args.variant == "scaled" else 1.0
    return make_multidigits(args.n_train, args.n_test, seed=args.data_seed, right_scale=scale,
                            regression=args.regression)


def config_from_args(args: argparse.Namespace) -> RunConfig:
    if args.noise > 0 and args.per_sample_clip is None:
        raise ValueError(
            f"--noise {args.noise} needs --per-sample-clip C: the noise is scaled by the "
            f"per-sample clip C (DP-SGD)"
        )
    return RunConfig(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                     optimizer=args.optimizer, weight_decay=args.weight_decay, trunk=args.trunk,
                     width=args.hidden, depth=args.depth, max_norm=args.max_norm,
                     per_sample_clip=args.per_sample_clip, noise_multiplier=args.noise,
                     log_every=args.log_every)


def needed_extras(args: argparse.Namespace, *, data: bool = True) -> list[Extra]:
    """The optional packages the options ask for (the data's, TensorBoard's, the plot's)."""
    extras = []
    if data:
        extras.append(Extra("sklearn", "data", "the MultiDigits data", package="scikit-learn"))
    if not args.no_tensorboard:
        extras.append(Extra("tensorboard", "tensorboard", "TensorBoard logs",
                            "pass --no-tensorboard"))
    if not args.no_plot:
        extras.append(Extra("matplotlib", "plot", "the plot", "pass --no-plot"))
    return extras


def check_extras(extras: list[Extra]) -> None:
    """Fail before any work, naming every missing optional package at once."""
    missing = missing_extras(extras)
    if missing:
        raise ImportError(missing_message(missing))


def _brief(result: RunResult, names: Sequence[str]) -> str:
    if result.error is not None:
        return f"{result.method.label:<14} seed {result.seed}: FAILED ({result.error})"
    parts = [f"{n} {v:.1f}" for n, v in zip(names, result.metrics) if not math.isnan(v)]
    return (f"{result.method.label:<14} seed {result.seed}: {', '.join(parts)}  "
            f"({result.step_ms:.2f} ms/step, {result.seconds:.1f}s)")


def execute(args: argparse.Namespace, methods: list[Method], *, baselines: bool,
            title: str, plot_name: str = "compare.png") -> int:
    """Build the data, train every (seed, method), write every output, print the table.

    ``--out`` is checked first (:class:`~gradbalance_lab._cli_common.OutputError`). On Ctrl-C
    the outputs of the runs that finished are written and 130 is returned.
    """
    try:
        check_extras(needed_extras(args))
    except ImportError as error:
        print(f"{title}: error: {error}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _execute(args, methods, baselines=baselines, title=title, plot_name=plot_name)
    finally:
        torch.set_num_threads(threads)


def _usable(data: MultiDigits, methods: list[Method], cfg: RunConfig,
            title: str) -> list[Method] | None:
    """The methods that can run on ``data`` (optional ones that cannot are skipped with a
    warning); None, after a message, when a requested one cannot."""
    usable = []
    for method in methods:
        try:
            check_method(data, method, cfg)
        except (ValueError, TypeError) as error:
            if not method.optional:
                print(f"{title}: error: {method.kind} {method.key!r} cannot run on this data: "
                      f"{error}", file=sys.stderr)
                return None
            warnings.warn(f"skipped {method.kind} {method.key!r}: {error}", RuntimeWarning,
                          stacklevel=3)
            continue
        usable.append(method)
    return usable


def _execute(args: argparse.Namespace, methods: list[Method], *, baselines: bool,
             title: str, plot_name: str) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as error:
        print(f"{title}: error: {error}", file=sys.stderr)
        return 2
    out: Path = args.out
    check_out(out, overwrite=args.overwrite)
    data = _fitting(f"--n-train {args.n_train} and --n-test {args.n_test}: the data",
                    lambda: data_from_args(args))
    _fitting(f"--hidden {args.hidden} and --depth {args.depth}: the model",
             lambda: build_model(data, cfg, list(range(data.num_tasks))))
    usable = _usable(data, methods, cfg, title)
    if usable is None:
        return 2
    singles = [Method("single", name, t) for t, name in enumerate(data.task_names)]
    plan = [(seed, m) for seed in range(args.seeds)
            for m in (singles if baselines else []) + usable]
    per_run = cfg.epochs * math.ceil(data.x_train.shape[0] / cfg.batch_size)
    folder = prepare_out(out, overwrite=args.overwrite, outputs=OUTPUTS)
    try:
        return _train_and_write(args, data, plan, cfg, per_run, folder, title, plot_name)
    except BaseException:
        folder.discard()  # a failure (or a second Ctrl-C) while writing: --out as it was
        raise


def _fitting(what: str, build: Callable[[], _T]) -> _T:
    """``build()``; a tensor too large for memory is :class:`OutputError` naming ``what``
    (the options and what they size)."""
    try:
        return build()
    except (MemoryError, RuntimeError, OverflowError) as error:
        text = str(error).lower()
        if isinstance(error, RuntimeError) and "alloc" not in text and "overflow" not in text:
            raise
        raise OutputError(f"{what} does not fit in this machine's memory; give smaller "
                          "values") from None


def _train_and_write(args: argparse.Namespace, data: MultiDigits,
                     plan: list[tuple[int, Method]], cfg: RunConfig, per_run: int,
                     folder: OutFolder, title: str, plot_name: str) -> int:
    """Train ``plan`` and write the outputs; a staged run replaces the earlier outputs only
    when every run finished (interrupted, it leaves them and its own in ``folder.work``)."""
    out = folder.final
    if not args.quiet:
        scales = ", ".join(f"{n}×{s:g}" for n, s in zip(data.task_names, data.loss_scales))
        print(f"{title}: MultiDigits {data.x_train.shape[0]} train / {data.x_test.shape[0]} "
              f"test canvases {tuple(data.input_shape)}, loss scales {scales}; "
              f"{len(plan)} runs of {per_run} steps", flush=True)
    timings = _timings(args, data, plan, cfg, title)
    results, interrupted = ([], True) if timings is None else _train_all(
        args, data, plan, cfg, per_run, folder.work)
    done = f"{len(results)} of {len(plan)} runs finished"
    heading = f"{title} (interrupted: {done})" if interrupted else title
    shown = folder.work if interrupted else out
    with shielded():
        _write_outputs(args, data, results, folder.work, shown, title=heading,
                       plot_name=plot_name, timings=timings or {})
        if not interrupted:
            commit_out(folder)
            return 0
    print_interrupted(title, done, out, folder.work)
    return 130


def print_interrupted(title: str, done: str, out: Path, work: Path) -> None:
    """stderr's line after Ctrl-C: ``done`` (``k of N runs finished``) and where the finished
    runs' outputs are (``work``: ``out`` itself, or an ``--overwrite`` run's own folder)."""
    if work != out:
        print(f"{title}: interrupted: {done}; the earlier outputs in {out}/ are kept; the "
              f"summary and CSVs of those runs are in {work}/", file=sys.stderr)
    else:
        print(f"{title}: interrupted: {done}; the summary and CSVs in {out}/ hold those runs "
              "only", file=sys.stderr)


def _timings(args: argparse.Namespace, data: MultiDigits, plan: list[tuple[int, Method]],
             cfg: RunConfig, title: str) -> dict[str, StepTime] | None:
    """The interleaved step times of the planned methods (``{}`` with ``--timing-rounds 0``
    or without the plain step); None when Ctrl-C stopped them."""
    methods = {PLAIN.label: PLAIN, **{m.label: m for _, m in plan if m.kind != "single"}}
    seeds = sorted({seed for seed, _ in plan})
    if args.timing_rounds == 0 or len(methods) == 1:
        return {}
    if not args.quiet:
        print(f"{title}: timing the step of {len(methods)} methods × {len(seeds)} seeds, "
              f"interleaved, {args.timing_rounds} rounds", file=sys.stderr, flush=True)
    try:
        return time_interleaved(lambda label, seed: step_timer(data, methods[label], seed, cfg),
                                list(methods), seeds, reference=PLAIN.label,
                                rounds=args.timing_rounds)
    except KeyboardInterrupt:
        return None


def _train_all(args: argparse.Namespace, data: MultiDigits, plan: list[tuple[int, Method]],
               cfg: RunConfig, per_run: int, work: Path) -> tuple[list[RunResult], bool]:
    """Train the runs of ``plan`` in order; returns the finished runs and whether Ctrl-C
    stopped the loop (the TensorBoard folder of the run it cut short is removed)."""
    progress = Progress(len(plan) * per_run, runs=len(plan), bar=not args.no_progress,
                        quiet=args.quiet)
    results: list[RunResult] = []
    running: Path | None = None
    try:
        for seed, method in plan:
            progress.describe(f"{method.label} seed {seed}")
            tb = None if args.no_tensorboard else work / "tb" / method.label / f"seed{seed}"
            running = tb
            results.append(_one_run(data, method, seed, cfg, progress, tb, per_run))
            running = None
            progress.finished_run(_brief(results[-1], data.metric_names))
    except KeyboardInterrupt:
        if running is not None:
            remove_run_logs(running)
        return results, True
    finally:
        progress.close()
    return results, False


def _one_run(data: MultiDigits, method: Method, seed: int, cfg: RunConfig, progress: Progress,
             tb: Path | None, per_run: int) -> RunResult:
    before = progress.done
    try:
        return train_run(data, method, seed, cfg, progress, tb)
    except (RuntimeError, ValueError, ArithmeticError) as error:
        # a solver that fails mid-run fails this run only, and the table says so
        progress.advance(per_run - (progress.done - before))
        return RunResult(method, seed, [math.nan] * data.num_tasks,
                         error=f"{type(error).__name__}: {error}")


def _write_outputs(args: argparse.Namespace, data: MultiDigits, results: list[RunResult],
                   out: Path, shown: Path, *, title: str, plot_name: str,
                   timings: dict[str, StepTime]) -> None:
    """Tables, config, plot and TensorBoard summary of ``results`` into ``out``; prints the
    table and the outputs' names in ``shown`` (where they end up)."""
    tasks = Tasks(data.task_names, data.metric_names, data.higher_is_better)
    written = write_report(out, results, timings, tasks, vars(args), title=title,
                           plot=None if args.no_plot else plot_name,
                           tensorboard=not args.no_tensorboard)
    print_outputs(written, shown, tensorboard=not args.no_tensorboard, quiet=args.quiet)


def print_outputs(written: Written, shown: Path, *, tensorboard: bool,
                  quiet: bool = False) -> None:
    """The table, then (unless ``quiet``: the table only) where the outputs are (``shown``:
    where they end up)."""
    print(written.table)
    if quiet:
        return
    print(f"outputs in {shown}/: " + ", ".join(p.name + ("/" if p.is_dir() else "")
                                               for p in written.paths))
    if tensorboard:
        print(f"view the training curves with: tensorboard --logdir {shown / 'tb'}")
