"""``gradbalance`` command line: one sub-command per module of :mod:`gradbalance_lab`.

Each command module defines ``HELP`` (one line), ``configure(parser)`` and ``run(args) -> int``.
Also run by ``python -m gradbalance`` and ``python -m gradbalance_lab``.

Exit codes: 0 success, 1 a command's own failure (e.g. an unmet claim of ``figures``), 2 a
usage error (a bad option value, an unusable ``--out``, a missing extra; one line on stderr),
130 interrupted (Ctrl-C; ``compare``/``train``/``figures`` first write what finished), 143
terminated (SIGTERM, handled like Ctrl-C: what finished is written first).
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from types import ModuleType
from typing import NoReturn

import torch

from gradbalance import __version__
from gradbalance_lab._cli_common import OutputError
from gradbalance_lab._signals import Terminated, sigterm_as_interrupt

__all__ = ["COMMANDS", "main", "version_text"]

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


def version_text() -> str:
    """``gradbalance <version> (torch <version>)``, as printed by ``gradbalance --version``."""
    return f"gradbalance {__version__} (torch {torch.__version__})"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, ``<prog>: error: <message>``, and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="gradbalance",
        description="Balance task gradients of multitask PyTorch models; experiments and demos.",
    )
    parser.add_argument("--version", action="version", version=version_text(),
                        help="print the gradbalance and torch versions and exit")
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
    with sigterm_as_interrupt() as received:
        code = _run(args)
    # a command stopped by SIGTERM reports it with 128 + 15, as an unhandled SIGTERM would
    return 128 + signal.SIGTERM if received and code == 130 else code


def _run(args: argparse.Namespace) -> int:
    try:
        return int(args._run(args) or 0)
    except OutputError as error:
        print(f"gradbalance {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        print(f"gradbalance {args.command}: {_stopped(stop)}", file=sys.stderr)
        return 130
    except ImportError as error:
        # an optional package the command needs is missing: the message names the extra
        if "pip install gradbalance[" not in str(error):
            raise
        print(f"gradbalance {args.command}: error: {error}", file=sys.stderr)
        return 2


def _stopped(stop: KeyboardInterrupt) -> str:
    return "terminated (SIGTERM)" if isinstance(stop, Terminated) else "interrupted"


if __name__ == "__main__":
    sys.exit(main())
