"""``python -m gradbalance``: the ``gradbalance`` command line (its commands live in the lab).

The lab is imported when the command runs, never when a core module is imported.
"""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run ``gradbalance`` with ``argv`` (default: the process's arguments)."""
    from gradbalance_lab.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
