"""``benchmarks/per_sample.py``: its peak-memory measure on known allocations, and a smoke
run (tiny models) that writes both tables."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def per_sample(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import per_sample  # type: ignore[import-not-found]

    return per_sample  # type: ignore[no-any-return]


def test_peak_bytes_is_the_most_alive_at_once(per_sample: ModuleType) -> None:
    mib = 2**18  # float32 elements in one MiB

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        a = torch.ones(mib)
        b = torch.ones(2 * mib)
        del a  # 3 MiB were alive together; then b and c, 2.5 MiB
        c = torch.ones(mib // 2)
        del b, c

    peak = per_sample.peak_bytes(step, torch.zeros(1), torch.zeros(1))
    assert peak == pytest.approx(3 * 2**20, rel=1e-3)


def test_quick_run_writes_both_tables(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(BENCHMARKS / "per_sample.py"), "--quick", "--rounds",
                    "1", "--warmup", "0", "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, timeout=600)
    text = (tmp_path / "per_sample_cpu-quick.md").read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines()
            if re.match(r"\| (mlp|cnn|transformer) \| ", line)]
    timed = {(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows if len(r) == 9}
    assert timed == {(m, b, n) for m in ("mlp", "cnn", "transformer")
                     for b in ("mgda", "upgrad") for n in ("4", "8")}
    memory = [r for r in rows if len(r) == 8]
    assert {(r[0].strip(), r[1].strip()) for r in memory} == {
        (m, n) for m in ("mlp", "cnn", "transformer") for n in ("4", "8")}
    for row in rows:
        values = [float(v) for v in row[2:] if v.strip() not in ("", "–")
                  and re.fullmatch(r"[0-9.]+", v.strip())]
        assert values and all(math.isfinite(v) and v >= 0 for v in values), row
