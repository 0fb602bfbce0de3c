"""A multi-node rehearsal: ``examples/fsdp_train.py`` as 2 "nodes" × 2 ranks on this machine.

Two ``torchrun --nnodes 2 --nproc_per_node 2 --node_rank {0,1}`` launches meet at a static
rendezvous on a free local port (node 0 hosts the store, as the first host of a cluster
would; docs/distributed.md, "Several nodes"). The 4 ranks shard the trunk 4 ways and print,
from global rank 0, the lines one process prints on the whole batch.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp_train.py"
TIMEOUT = 300  # seconds for both launches together
TEARDOWN = "terminate called without an active exception"  # see test_examples.py
TEARDOWN_GRACE_S = 15.0  # a node still running this long after the run finished is stopped
FINISHED = "4 rank(s) finished"  # rank 0's last line, after the ranks' collective checksum

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is unavailable")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _node(rank: int, port: int, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """One "node": a torchrun of 2 ranks writing to ``log.out``/``log.err``, in its own
    session (ended by :func:`_stop`)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.with_suffix(".out").open("wb") as out, log.with_suffix(".err").open("wb") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
             "--nproc_per_node", "2", "--node_rank", str(rank), "--master_addr", "127.0.0.1",
             "--master_port", str(port), str(EXAMPLE), *args],
            stdout=out, stderr=err, env=env, start_new_session=True)


def _stop(nodes: list[subprocess.Popen[bytes]]) -> None:
    """End the launches still running: SIGTERM first (torchrun ends its ranks, which run in
    sessions of their own), SIGKILL for one that has not ended after a grace period."""
    running = [node for node in nodes if node.poll() is None]
    for node in running:
        os.killpg(node.pid, signal.SIGTERM)
    for node in running:
        try:
            node.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()


def _finished(logs: Path) -> bool:
    """Whether rank 0 printed its last line: every rank took part in the checksum before it,
    so the training itself is over on all four ranks."""
    lines = (logs / "node0.out").read_text().splitlines()
    return bool(lines) and lines[-1] == FINISHED


Launch = Callable[[int, int, list[str], Path], "subprocess.Popen[bytes]"]


def _two_nodes(args: list[str], logs: Path,
               launch: Launch = _node) -> list[tuple[int | None, str, str, bool]]:
    """Both nodes launched together: (return code, stdout, stderr, stopped) of each.

    A node that fails before the run finished, or a run past :data:`TIMEOUT`, ends both:
    neither launch nor its ranks outlive the call. Once rank 0 reports the run finished, a
    node still running :data:`TEARDOWN_GRACE_S` later is in the gloo/torchrun teardown (an
    abort in one node's teardown must not end the other's): it is stopped and ``stopped`` is
    True for it (docs/distributed.md, "Several nodes")."""
    port = _free_port()
    nodes = [launch(rank, port, args, logs / f"node{rank}") for rank in (0, 1)]
    deadline = time.monotonic() + TIMEOUT
    finished_at: float | None = None
    stopped = [False, False]
    try:
        while time.monotonic() < deadline:
            codes = [node.poll() for node in nodes]
            if all(code is not None for code in codes):
                break
            if finished_at is None and _finished(logs):
                finished_at = time.monotonic()
            if finished_at is None and any(codes):
                break  # one failed before the end: the other would wait for it
            if finished_at is not None and time.monotonic() > finished_at + TEARDOWN_GRACE_S:
                break
            time.sleep(0.2)
        stopped = [finished_at is not None and node.poll() is None for node in nodes]
    finally:
        _stop(nodes)
    return [(node.returncode, (logs / f"node{rank}.out").read_text(),
             (logs / f"node{rank}.err").read_text(), stopped[rank])
            for rank, node in enumerate(nodes)]


def test_two_nodes_of_two_ranks_print_the_single_process_run(tmp_path: Path) -> None:
    from support.sibling import load_sibling

    args = ["--balancer", "mgda", "--micro", "2"]
    single = load_sibling(__file__, "test_fsdp_example")._run(str(EXAMPLE), *args)  # 6 steps
    nodes = _two_nodes([*args, "--steps", "6"], tmp_path)
    (code0, out0, err0, stopped0), (code1, out1, err1, stopped1) = nodes
    lines = out0.splitlines()
    finished = bool(lines) and lines[-1] == FINISHED
    assert code0 == 0 or (finished and (TEARDOWN in err0 or stopped0)), (code0, err0[-2000:])
    assert code1 == 0 or (finished and (TEARDOWN in err1 or stopped1)), (code1, err1[-2000:])
    assert out1 == ""  # node 1 holds global ranks 2 and 3: rank 0 alone prints
    assert single[-1] == "1 rank(s) finished" and finished
    steps = [line for line in single if line.startswith(("step", "parameters"))]
    assert len(steps) == 3  # steps 0 and 5, the parameters' digest
    assert steps == [line for line in lines if line.startswith(("step", "parameters"))]


def _scripted(scripts: tuple[str, str]) -> Launch:
    """A stand-in for :func:`_node`: node ``rank`` runs ``python -c scripts[rank]``."""
    def launch(rank: int, port: int, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.with_suffix(".out").open("wb") as out, log.with_suffix(".err").open("wb") as err:
            return subprocess.Popen([sys.executable, "-c", scripts[rank]], stdout=out,
                                    stderr=err, start_new_session=True)
    return launch


ABORT_AFTER_FINISHED = f"print({FINISHED!r}, flush=True); import os; os.abort()"
HANG = "import time; time.sleep(600)"


def test_a_node_left_in_its_teardown_after_the_run_finished_is_stopped_and_accepted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "TEARDOWN_GRACE_S", 0.5)
    (code0, out0, _, stopped0), (code1, _, _, stopped1) = _two_nodes(
        [], tmp_path, _scripted((ABORT_AFTER_FINISHED, HANG)))
    assert out0.splitlines()[-1] == FINISHED and code0 not in (None, 0) and not stopped0
    assert stopped1 and code1 == -signal.SIGTERM  # ended by _stop, not by node 0's abort


def test_a_node_failing_before_the_run_finished_ends_both_unaccepted(
        tmp_path: Path) -> None:
    (code0, out0, _, stopped0), (code1, _, _, stopped1) = _two_nodes(
        [], tmp_path, _scripted(("raise SystemExit(3)", HANG)))
    assert code0 == 3 and out0 == "" and not stopped0
    assert not stopped1 and code1 == -signal.SIGTERM  # stopped at once, not accepted
