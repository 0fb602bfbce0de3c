"""The examples of docs/integrations.md (Lightning, Hugging Face, Accelerate, torch.compile)
run as written: each ```python block in a fresh namespace, in a temporary folder."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
NEEDS = {"lightning": "lightning.pytorch", "transformers": "transformers",
         "accelerate": "accelerate"}

pytestmark = pytest.mark.filterwarnings("ignore")


def _needed(code: str) -> list[str]:
    imported = set(re.findall(r"^(?:from|import) (\w+)", code, flags=re.M))
    return [NEEDS[name] for name in sorted(imported & set(NEEDS))]


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A temporary working folder, fresh accelerate singletons and compile caches."""
    monkeypatch.chdir(tmp_path)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    try:
        from accelerate.state import AcceleratorState, GradientState
    except ImportError:
        return
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_the_page_has_one_example_per_framework() -> None:
    assert len(BLOCKS) == 4
    assert [_needed(code) for code in BLOCKS] == [["lightning.pytorch"], ["transformers"],
                                                  ["accelerate"], []]
    assert "torch.compile(" in BLOCKS[3]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs(index: int) -> None:
    for module in _needed(BLOCKS[index]):
        pytest.importorskip(module)
    exec(compile(BLOCKS[index], f"{PAGE.name}[{index}]", "exec"), {"__name__": "example"})
