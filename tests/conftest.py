"""Shared test set-up. Helpers importable by every test live in the ``support`` package
(``tests/support/``): model builders, reference implementations, DDP and Lightning drivers;
fixtures live in the ``conftest.py`` of the folder they apply to.

Layout: ``unit/<package>/`` mirrors ``src/gradbalance/<package>`` (``unit/core/`` its
top-level modules), ``integration/`` holds whole training loops (AMP, checkpoints, DDP,
Lightning, examples, benchmarks), ``lab/`` the ``gradbalance_lab`` package (CLI, figures,
bundled data).
"""
