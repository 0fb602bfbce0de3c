"""``gradbalance compare``: balancers and loss weightings side by side on MultiDigits.

Trains one shared trunk with a head per task for every chosen method and seed, plus one
single-task model per task and seed (the Δm baseline), then prints and writes the table of
per-task test metrics (mean ± std over seeds), Δm % and the step time relative to the plain
step ``losses.sum().backward()`` (timed interleaved: :mod:`gradbalance_lab._mtl_timing`).
``--per-sample`` runs the balancers over the per-sample losses instead
(:mod:`gradbalance_lab._per_sample_methods`).
"""

from __future__ import annotations

import argparse
import sys
import types
from typing import Any

import torch

from gradbalance.balancers import BALANCERS
from gradbalance_lab._cli_common import check_out, int_at_least
from gradbalance_lab._factory import load_factory
from gradbalance_lab._mtl_cli import (
    add_common_options,
    check_extras,
    execute,
    needed_extras,
    print_interrupted,
    print_outputs,
)
from gradbalance_lab._mtl_methods import (
    DEFAULT_BALANCERS,
    DEFAULT_WEIGHTINGS,
    Method,
    available_weightings,
    resolve_methods,
    runnable,
)
from gradbalance_lab._mtl_outputs import Written
from gradbalance_lab._own_compare import (
    Comparison,
    ComparisonInterrupted,
    compare,
    compare_methods,
    default_methods,
)
from gradbalance_lab._per_sample_methods import DEFAULT_PER_SAMPLE, resolve_per_sample

__all__ = ["HELP", "Comparison", "compare", "configure", "default_methods", "run"]

HELP = "compare balancers and loss weightings on the bundled MultiDigits benchmark"


def _names(text: str, option: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:  # "" or ",,": silently read as 'none' before
        raise ValueError(f"Invalid {option}: {text!r} (expected comma-separated names, 'all' "
                         "or 'none')")
    return names


def configure(parser: argparse.ArgumentParser) -> None:
    methods = parser.add_argument_group("methods")
    methods.add_argument(
        "--balancers", default=None,
        help="comma-separated balancer names, 'all' or 'none' (default: "
             f"{','.join(DEFAULT_BALANCERS)}); 'sum' always runs; the plain step "
             "(losses.sum().backward(), no library) is timed beside every method as the "
             "reference of '× plain step'. "
             f"Installed: {', '.join(sorted(BALANCERS))}")
    methods.add_argument(
        "--weightings", default=None,
        help="comma-separated loss-weighting names, 'all' or 'none', each run through its "
             "one-pass path weighting(losses).sum().backward() (default: "
             f"{','.join(DEFAULT_WEIGHTINGS)}). "
             f"Installed: {', '.join(sorted(available_weightings())) or 'none'}")
    methods.add_argument("--no-baselines", action="store_true",
                         help="skip the single-task models (no Δm column)")
    methods.add_argument(
        "--per-sample", action="store_true",
        help="instance-wise: every balancer combines the B x K per-sample (sample x task) "
             "losses of the batch (TaskGradBuffer(batch_dim=0)), against 'sum', the plain "
             f"mean; default balancers {','.join(DEFAULT_PER_SAMPLE)}, no loss weightings "
             "(docs/compare.md, 'Per-sample objectives')")
    own = parser.add_argument_group(
        "your own model (instead of MultiDigits; the data, trunk and training options are then "
        "refused)")
    own.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY",
                     help="compare on your model and data: FACTORY() returns "
                          "dict(build_model=..., make_batches=..., [shared, evaluate, "
                          "higher_is_better, task_names, optimizer]), the arguments of "
                          "gradbalance_lab.compare.compare (docs/compare.md, 'Your own model')")
    own.add_argument("--steps", type=int_at_least(1), default=200,
                     help="training steps of each run with --model")
    add_common_options(parser, seeds=3, out="runs/compare")


def _chosen(args: argparse.Namespace) -> list[Method]:
    """``--balancers`` and ``--weightings`` as methods (with ``all``, those that cannot run
    are skipped with a warning)."""
    everything = "all" in (str(args.balancers).strip().lower(),
                           str(args.weightings).strip().lower())
    return resolve_methods(_choice(args.balancers, BALANCERS, "--balancers"),
                           _choice(args.weightings, available_weightings(), "--weightings"),
                           optional=everything)


def _choice(text: str | None, registry: dict[str, Any], option: str) -> list[str] | None:
    if text is None:
        return None
    if text.strip().lower() == "all":
        return runnable(registry)
    if text.strip().lower() == "none":
        return []
    return _names(text, option)


#: The options of the MultiDigits comparison that ``--model`` does not use: given with it,
#: they are refused by name (the factory sets the user's model, data and optimizer).
_MULTIDIGITS_ONLY = ("variant", "right_scale", "regression", "n_train", "n_test", "data_seed",
                     "epochs", "batch_size", "optimizer", "lr", "weight_decay", "trunk",
                     "hidden", "depth", "max_norm", "per_sample_clip", "noise")


def _unused_options(args: argparse.Namespace) -> list[str]:
    """The MultiDigits-only options given a value other than their default."""
    parser = argparse.ArgumentParser()
    configure(parser)
    defaults = vars(parser.parse_args([]))
    return ["--" + name.replace("_", "-") for name in _MULTIDIGITS_ONLY
            if getattr(args, name) != defaults[name]]


def _run_own(args: argparse.Namespace) -> int:
    """``--model``: :func:`compare` on the user's factory, with the command's options."""
    check_out(args.out, overwrite=args.overwrite)  # the command's message, before any work
    title = "gradbalance compare"
    try:
        unused = _unused_options(args)
        if unused:
            raise ValueError(f"--model does not take {', '.join(unused)}: they set up "
                             "MultiDigits' data, trunk and training (clipping and DP-SGD "
                             "included); give your model's settings in the factory's dict "
                             "(build_model, make_batches, optimizer)")
        spec = load_factory(args.model)
        wanted = str(args.balancers).lower()  # 'sum' equals the plain row: only when asked
        methods = [m for m in _chosen(args) if m.label != "sum" or args.balancers is None
                   or "sum" in wanted or wanted.strip() == "all"]
        check_extras(needed_extras(args, data=False))
        threads = torch.get_num_threads()
        torch.set_num_threads(args.threads)
        try:
            result = compare_methods(
                **spec, chosen=methods, steps=args.steps, seeds=args.seeds,
                timing_rounds=args.timing_rounds, out=args.out, overwrite=args.overwrite,
                plot=not args.no_plot, tensorboard=not args.no_tensorboard,
                verbose=not args.quiet, log_every=args.log_every)
        finally:
            torch.set_num_threads(threads)
    except (ValueError, TypeError, ImportError) as error:
        print(f"{title}: error: {error}", file=sys.stderr)
        return 2
    except ComparisonInterrupted as stop:
        _print_result(stop.comparison, args)
        assert stop.final is not None and stop.comparison.out is not None
        print_interrupted(title, stop.done, stop.final, stop.comparison.out)
        return 130
    _print_result(result, args)
    return 0


def _print_result(result: Comparison, args: argparse.Namespace) -> None:
    assert result.out is not None
    print_outputs(Written(result.rows, result.table, sorted(result.out.iterdir())), result.out,
                  tensorboard=not args.no_tensorboard, quiet=args.quiet)


def _per_sample_methods(args: argparse.Namespace) -> list[Method]:
    """``--per-sample``'s methods; a ValueError for the options it cannot take."""
    for given, option, why in (
            (args.model is not None, f"--model {args.model}", "it runs on MultiDigits"),
            (args.weightings not in (None, "none"), f"--weightings {args.weightings}",
             "loss weightings weight the K task losses (pass --weightings none)"),
            (args.per_sample_clip is not None, f"--per-sample-clip {args.per_sample_clip}",
             "per-sample clipping and per-sample objectives are two routes; drop one")):
        if given:
            raise ValueError(f"--per-sample does not take {option}: {why}")
    return resolve_per_sample(_choice(args.balancers, BALANCERS, "--balancers"),
                              optional=str(args.balancers).strip().lower() == "all")


def run(args: argparse.Namespace) -> int:
    if args.per_sample:
        try:
            methods = _per_sample_methods(args)
        except ValueError as error:
            print(f"gradbalance compare: error: {error}", file=sys.stderr)
            return 2
        return execute(args, methods, baselines=not args.no_baselines,
                       title="gradbalance compare --per-sample")
    if args.model is not None:
        return _run_own(args)
    try:
        methods = _chosen(args)
    except ValueError as error:
        print(f"gradbalance compare: error: {error}", file=sys.stderr)
        return 2
    return execute(args, methods, baselines=not args.no_baselines,
                   title="gradbalance compare")


class _CallableModule(types.ModuleType):
    """This module, callable: ``gradbalance_lab.compare(build_model, make_batches, ...)`` is
    :func:`compare` (``from gradbalance_lab.compare import compare`` is the same function)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Comparison:
        return compare(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
