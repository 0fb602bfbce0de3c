"""Shared test set-up. Helpers importable by every test live in the ``support`` package
(``tests/support/``): model builders, reference implementations, DDP and Lightning drivers;
fixtures live in the ``conftest.py`` of the folder they apply to.

Layout: ``unit/<package>/`` mirrors ``src/gradbalance/<package>`` (``unit/core/`` its
top-level modules), ``integration/`` holds whole training loops (AMP, checkpoints, DDP,
Lightning, examples, benchmarks), ``lab/`` the ``gradbalance_lab`` package (CLI, figures,
bundled data).
"""

import os

from hypothesis import settings

# CI replays the same examples every run (``derandomize``); set HYPOTHESIS_PROFILE=explore to
# draw fresh ones while developing.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
