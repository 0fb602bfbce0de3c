"""``gradbalance`` command line: one sub-command per module of :mod:`gradbalance_lab`.

Each command module defines ``HELP`` (one line), ``configure(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

__all__ = ["COMMANDS", "main"]

#: sub-command -> module implementing it.
COMMANDS: dict[str, str] = {
    "compare": "gradbalance_lab.compare",
    "train": "gradbalance_lab.train",
    "figures": "gradbalance_lab.figures",
}


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(COMMANDS[name])
    except ModuleNotFoundError as error:
        if error.name == COMMANDS[name]:
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradbalance",
        description="Balance task gradients of multitask PyTorch models; experiments and demos.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = _load(name)
        if module is None:
            continue
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.configure(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "_run", None) is None:
        parser.print_help()
        return 2
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
