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
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp_train.py"
TIMEOUT = 300  # seconds for both launches together
TEARDOWN = "terminate called without an active exception"  # see test_examples.py

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


def _two_nodes(args: list[str], logs: Path) -> list[tuple[int | None, str, str]]:
    """Both nodes launched together: (return code, stdout, stderr) of each. A node that fails
    or a run past :data:`TIMEOUT` ends both: neither launch nor its ranks outlive the call."""
    port = _free_port()
    nodes = [_node(rank, port, args, logs / f"node{rank}") for rank in (0, 1)]
    deadline = time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:
            codes = [node.poll() for node in nodes]
            if all(code is not None for code in codes) or any(codes):
                break  # both done, or one failed: the other would wait for it
            time.sleep(0.2)
    finally:
        _stop(nodes)
    return [(node.returncode, (logs / f"node{rank}.out").read_text(),
             (logs / f"node{rank}.err").read_text()) for rank, node in enumerate(nodes)]


def test_two_nodes_of_two_ranks_print_the_single_process_run(tmp_path: Path) -> None:
    from support.sibling import load_sibling

    args = ["--balancer", "mgda", "--micro", "2"]
    single = load_sibling(__file__, "test_fsdp_example")._run(str(EXAMPLE), *args)  # 6 steps
    (code0, out0, err0), (code1, out1, err1) = _two_nodes([*args, "--steps", "6"], tmp_path)
    lines = out0.splitlines()
    finished = bool(lines) and lines[-1] == "4 rank(s) finished"
    assert code0 == 0 or (finished and TEARDOWN in err0), (code0, err0[-2000:])
    assert code1 == 0 or (finished and TEARDOWN in err1), (code1, err1[-2000:])
    assert out1 == ""  # node 1 holds global ranks 2 and 3: rank 0 alone prints
    assert single[-1] == "1 rank(s) finished" and finished
    steps = [line for line in single if line.startswith(("step", "parameters"))]
    assert len(steps) == 3  # steps 0 and 5, the parameters' digest
    assert steps == [line for line in lines if line.startswith(("step", "parameters"))]
