"""``python -m gradbalance_lab``: the ``gradbalance`` command line."""

from __future__ import annotations

import sys

from gradbalance_lab.cli import main

if __name__ == "__main__":
    sys.exit(main())
