"""docs/per_sample.md: its example runs as written and trains; the page is in the nav; the
benchmark it cites runs."""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "per_sample.md"


def test_example_trains_with_per_sample_weights() -> None:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    assert len(blocks) == 1
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(blocks[0], "per_sample.md", "exec"), namespace)
    assert "weights (16,)" in printed.getvalue()
    trunk, x, y = namespace["trunk"], namespace["x"], namespace["y"]
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    with torch.no_grad():
        mse = float(((trunk(x) - y) ** 2).mean())  # type: ignore[operator]
    assert mse < 0.25 * float(((y - y.mean()) ** 2).mean())  # far below the constant fit
    weights = namespace["stats"].weights  # type: ignore[attr-defined]
    assert weights.shape == (16,) and bool((weights >= 0).all())  # UPGrad: non-negative


def test_nav_lists_the_page() -> None:
    assert "per_sample.md" in (ROOT / "mkdocs.yml").read_text()


def test_benchmark_writes_its_table(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "per_sample.py"), "--models",
                    "mlp", "--batches", "4", "--balancers", "mgda", "--rounds", "1", "--warmup",
                    "0", "--out", str(tmp_path)], check=True, cwd=ROOT / "benchmarks",
                   capture_output=True)
    rows = [line for line in (tmp_path / "per_sample_cpu.md").read_text().splitlines()
            if line.startswith("| mlp | mgda | 4 |")]
    assert len(rows) == 1
