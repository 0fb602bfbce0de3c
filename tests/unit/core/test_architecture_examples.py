"""The worked examples of docs/ARCHITECTURE.md (a balancer, a weighting, a row clipper, a
mode) run as written: each ```python block is executed in a fresh namespace, and its own
assertions (against hand-derived values) decide."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PAGE = Path(__file__).resolve().parents[3] / "docs" / "ARCHITECTURE.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)


def test_the_page_has_the_four_examples() -> None:
    assert len(BLOCKS) == 4


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_example_runs(index: int) -> None:
    from gradbalance.modes import ENGINES

    before = dict(ENGINES)
    exec(compile(BLOCKS[index], f"{PAGE.name}[{index}]", "exec"), {"__name__": "example"})
    assert before == ENGINES  # an example leaves the library as it found it
