"""The benchmark scripts run end to end (tiny models) and write their tables."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _run(script: str, *args: str) -> None:
    subprocess.run([sys.executable, str(BENCHMARKS / script), *args], check=True,
                   capture_output=True, text=True, timeout=600)


def _ratios(row: str) -> list[float]:
    """The row's numeric cells (signed: LB is a difference of medians, which a noisy machine
    can push below zero)."""
    return [float(v) for v in re.findall(r"\| (-?[0-9.]+(?:e[-+]?[0-9]+)?)", row)]


def test_step_overhead_quick_writes_every_requested_variant(tmp_path: Path) -> None:
    _run("step_overhead.py", "--quick", "--trunks", "mlp", "--ks", "2", "--rounds", "1",
         "--variants", "matrix-mgda,passes,persample", "--memory-ks", "",
         "--amortise-ks", "", "--out", str(tmp_path), "--name", "smoke")
    text = (tmp_path / "smoke_cpu-quick.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines()
            if line.startswith("| ")}
    for name in ("LB", "matrix-mgda", "passes-loop", "passes-batched",
                 "persample-graph-mgda", "persample-model-mgda", "persample-ghost-mgda"):
        values = _ratios(rows[name])
        assert values and all(math.isfinite(v) for v in values), rows[name]
        if name != "LB":  # a measured time over the plain step's: positive by construction
            assert all(v > 0 for v in values), rows[name]


def test_gramian_crossover_quick_writes_its_table(tmp_path: Path) -> None:
    _run("gramian_crossover.py", "--quick", "--batches", "2,8", "--rounds", "1",
         "--out", str(tmp_path))
    lines = [line for line in (tmp_path / "gramian_crossover_cpu-quick.md").read_text()
             .splitlines() if re.match(r"\| \d", line)]
    assert [line.split("|")[1].strip() for line in lines] == ["2", "8"]
    assert all(len(_ratios(line)) == 8 for line in lines)  # LB … gramian/matrix, auto, auto/best


def test_clip_cost_quick_prints_its_table() -> None:
    done = subprocess.run([sys.executable, str(BENCHMARKS / "clip_cost.py"), "--quick"],
                          check=True, capture_output=True, text=True, timeout=600)
    rows = [line for line in done.stdout.splitlines() if line.startswith("| mlp-")]
    assert len(rows) == 2
    for row in rows:
        values = _ratios(row)
        assert values and all(math.isfinite(v) and v > 0 for v in values), row
