"""``examples/fsdp_train.py`` under torchrun on 2 CPU ranks prints the single-process run;
``benchmarks/fsdp_cost.py --quick`` writes its table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "fsdp_train.py"

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is unavailable")


def _run(*command: str) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *command, "--steps", "6"], capture_output=True,
                          text=True, timeout=300, env=env, check=False)
    lines = proc.stdout.splitlines()
    # gloo's teardown may abort rank 0 after the run has finished (see test_examples.py)
    finished = bool(lines) and lines[-1].endswith("finished")
    teardown = "terminate called without an active exception" in proc.stderr
    assert proc.returncode == 0 or (finished and teardown), proc.stderr[-2000:]
    return lines


def test_two_sharded_ranks_print_the_single_process_run() -> None:
    single = _run(str(EXAMPLE), "--balancer", "mgda", "--micro", "2")
    sharded = _run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   str(EXAMPLE), "--balancer", "mgda", "--micro", "2")
    assert single[-1] == "1 rank(s) finished" and sharded[-1] == "2 rank(s) finished"
    steps = [line for line in single if line.startswith(("step", "parameters"))]
    assert len(steps) == 3  # steps 0 and 5, the parameters' digest
    assert steps == [line for line in sharded if line.startswith(("step", "parameters"))]


def test_fsdp_cost_quick_counts_the_collectives_of_k_passes(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fsdp_cost.py"), "--quick",
                    "--out", str(tmp_path), "--limit", "240"],
                   check=True, capture_output=True, text=True, timeout=300, env=env)
    rows = {line.split("|")[2].strip(): line.split("|")
            for line in (tmp_path / "fsdp_cost_cpu-quick.md").read_text().splitlines()
            if line.startswith("| 2 ")}
    assert set(rows) == {"default", "keep-forward", "keep-backward", "keep-both"}
    # K = 2 on 3 wrapped layers: the forward's 3 all-gathers, 3 more per pass (fewer when the
    # parameters stay gathered), one small all-gather of the ranks' agreement; 3 reduce-
    # scatters per pass
    calls = {name: row[8].split(",") for name, row in rows.items()}
    assert {name: [c.strip() for c in value] for name, value in calls.items()} == {
        "default": ["10 AG", "6 RS", "4 AR"], "keep-forward": ["7 AG", "6 RS", "4 AR"],
        "keep-backward": ["7 AG", "6 RS", "4 AR"], "keep-both": ["4 AG", "6 RS", "4 AR"]}
