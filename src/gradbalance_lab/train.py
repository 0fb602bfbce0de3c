"""``gradbalance train``: one method on MultiDigits, with the outputs of ``compare``."""

from __future__ import annotations

import argparse
import sys

from gradbalance.balancers import BALANCERS
from gradbalance_lab._mtl_cli import add_common_options, execute
from gradbalance_lab._mtl_methods import available_weightings, resolve_methods

HELP = "train one balancer (or loss weighting) on MultiDigits and log it"


def configure(parser: argparse.ArgumentParser) -> None:
    method = parser.add_argument_group("method (give one)")
    method.add_argument("--balancer", default=None, type=_name,
                        help=f"balancer name; installed: {', '.join(sorted(BALANCERS))}")
    method.add_argument("--weighting", default=None, type=_name,
                        help="loss-weighting name (run with the plain sum); installed: "
                             f"{', '.join(sorted(available_weightings())) or 'none'}")
    method.add_argument("--baselines", action="store_true",
                        help="also train single-task models, for the Δm column")
    add_common_options(parser, seeds=1, out="runs/train")


def _name(text: str) -> str:
    """A method's name: not empty (``--balancer ""`` trained nothing and exited 0)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"invalid name: {text!r} (expected a method's name)")
    return text.strip()


def run(args: argparse.Namespace) -> int:
    if (args.balancer is None) == (args.weighting is None):
        print("gradbalance train: error: give exactly one of --balancer NAME or "
              "--weighting NAME", file=sys.stderr)
        return 2
    try:
        methods = resolve_methods([] if args.balancer is None else [args.balancer],
                                  [] if args.weighting is None else [args.weighting],
                                  options=("--balancer", "--weighting"), with_sum=False)
    except ValueError as error:
        print(f"gradbalance train: error: {error}", file=sys.stderr)
        return 2
    return execute(args, methods, baselines=args.baselines, title="gradbalance train",
                   plot_name="train.png")

