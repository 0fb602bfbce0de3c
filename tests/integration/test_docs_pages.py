"""The install and quickstart pages: their code runs as written and does what the text says."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), re.S)


def test_quickstart_trains_both_tasks() -> None:
    blocks = _python_blocks("quickstart.md")
    assert blocks, "quickstart.md has no python block"
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        for block in blocks:
            exec(compile(block, "quickstart.md", "exec"), namespace)
    assert printed.getvalue().count("cos(task0, task1)") == 4  # steps 0, 50, 100, 150
    x, y = namespace["x"], namespace["y"]
    trunk, heads = namespace["trunk"], namespace["heads"]
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    with torch.no_grad():
        feats = trunk(x)  # type: ignore[operator]
        for k, head in enumerate(heads):  # type: ignore[call-overload]
            mse = ((head(feats)[:, 0] - y[:, k]) ** 2).mean()
            # Trained: far below the error of predicting the mean (the target's variance).
            assert mse < 0.05 * y[:, k].var(), (k, float(mse), float(y[:, k].var()))


def test_nav_lists_install_and_quickstart() -> None:
    nav = (DOCS.parent / "mkdocs.yml").read_text()
    assert "install.md" in nav and "quickstart.md" in nav
