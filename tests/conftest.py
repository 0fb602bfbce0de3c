"""Shared test set-up. Helpers importable by every test live in the ``support`` package
(``tests/support/``): model builders, reference implementations, DDP and Lightning drivers;
fixtures live in the ``conftest.py`` of the folder they apply to.

Layout: ``unit/<package>/`` mirrors ``src/gradbalance/<package>`` (``unit/core/`` its
top-level modules), ``integration/`` holds whole training loops (AMP, checkpoints, DDP,
Lightning, examples, benchmarks), ``lab/`` the ``gradbalance_lab`` package (CLI, figures,
bundled data).
"""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI replays the same examples every run (``derandomize``); set HYPOTHESIS_PROFILE=explore to
# draw fresh ones while developing.
# No deadline and no too-slow health check: a loaded 2-core machine must not fail a property
# that holds.
_PATIENT = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("ci", derandomize=True, print_blob=True, **_PATIENT)
settings.register_profile("explore", print_blob=True, **_PATIENT)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# ``make test`` runs one pytest-xdist worker per core: each takes one torch thread, since two
# threads per worker would oversubscribe the cores (intra-op threads then stall each other).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)



def _seed_line(config: pytest.Config) -> str | None:
    """The random order's seed (pytest-randomly) and the command that replays it."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is None or not getattr(config.option, "randomly_reorganize", True):
        return None
    return (f"random test order: seed {seed}; "
            f"replay with make test PYTEST_ARGS=--randomly-seed={seed} TEST_WORKERS=0")


def pytest_collection_finish(session: pytest.Session) -> None:
    line = _seed_line(session.config)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None:
        reporter.write_line(line)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int,
                            config: pytest.Config) -> None:
    line = _seed_line(config)
    if line:
        terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def _isolated_torch_globals(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test starts from torch's global RNG seeded with the run's seed and leaves the
    thread count as it found it, so no test depends on the ones that ran before it."""
    threads = torch.get_num_threads()
    torch.manual_seed(getattr(request.config.option, "randomly_seed", None) or 0)
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture()
def one_thread() -> None:
    """One torch thread for the test (``_isolated_torch_globals`` restores the count): the
    solvers' tests at K ≤ 100 are faster on one, and not slowed by a busy machine. A module
    takes it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    torch.set_num_threads(1)


@pytest.fixture()
def one_process_group(tmp_path: Path) -> Iterator[None]:
    """A gloo world of this process alone (``fully_shard`` needs a process group)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
