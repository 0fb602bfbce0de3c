"""``gradbalance compare``: balancers and loss weightings side by side on MultiDigits.

Trains one shared trunk with a head per task for every chosen method and seed, plus one
single-task model per task and seed (the Δm baseline), then prints and writes the table of
per-task test metrics (mean ± std over seeds), Δm % and the step time relative to the plain
step ``losses.sum().backward()`` (timed interleaved: :mod:`gradbalance_lab._mtl_timing`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gradbalance.balancers import BALANCERS
from gradbalance_lab._mtl_cli import add_common_options, execute
from gradbalance_lab._mtl_methods import (
    DEFAULT_BALANCERS,
    DEFAULT_WEIGHTINGS,
    available_weightings,
    resolve_methods,
    runnable,
)

HELP = "compare balancers and loss weightings on the bundled MultiDigits benchmark"


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def configure(parser: argparse.ArgumentParser) -> None:
    methods = parser.add_argument_group("methods")
    methods.add_argument(
        "--balancers", default=None,
        help="comma-separated balancer names, 'all' or 'none' (default: "
             f"{','.join(DEFAULT_BALANCERS)}); the plain step (losses.sum().backward(), "
             "no balancing) always runs as the time reference. "
             f"Installed: {', '.join(sorted(BALANCERS))}")
    methods.add_argument(
        "--weightings", default=None,
        help="comma-separated loss-weighting names, 'all' or 'none', each run through its "
             "one-pass path weighting(losses).sum().backward() (default: "
             f"{','.join(DEFAULT_WEIGHTINGS)}). "
             f"Installed: {', '.join(sorted(available_weightings())) or 'none'}")
    methods.add_argument("--no-baselines", action="store_true",
                         help="skip the single-task models (no Δm column)")
    add_common_options(parser, seeds=3, out="runs/compare")


def _choice(text: str | None, registry: dict[str, Any]) -> list[str] | None:
    if text is None:
        return None
    if text.strip().lower() == "all":
        return runnable(registry)
    if text.strip().lower() == "none":
        return []
    return _names(text)


def run(args: argparse.Namespace) -> int:
    try:
        everything = "all" in (str(args.balancers).lower(), str(args.weightings).lower())
        methods = resolve_methods(_choice(args.balancers, BALANCERS),
                                  _choice(args.weightings, available_weightings()),
                                  optional=everything)
    except ValueError as error:
        print(f"gradbalance compare: error: {error}", file=sys.stderr)
        return 2
    return execute(args, methods, baselines=not args.no_baselines,
                   title="gradbalance compare")
