"""The core's functions stay small: radon's cyclomatic complexity, counted the way
docs/ARCHITECTURE.md ("Small functions") states the rule. ruff's C901 (mccabe, a slightly
different count) enforces the same limit of 12 in `make test`'s lint step."""

from __future__ import annotations

from pathlib import Path

import pytest

radon_complexity = pytest.importorskip("radon.complexity")

CORE = Path(__file__).resolve().parents[3] / "src" / "gradbalance"
LIMIT = 12
# Functions allowed above LIMIT, by "<file>:<name>"; the list only shrinks.
ALLOWED: set[str] = set()


def _blocks() -> set[tuple[str, str, int]]:
    """(file, function, complexity) for every function, method and closure of the core."""
    found: dict[tuple[str, int], tuple[str, str, int]] = {}
    for path in sorted(CORE.rglob("*.py")):
        code = path.read_text(encoding="utf-8")
        stack = list(radon_complexity.cc_visit(code))
        while stack:
            block = stack.pop()
            file = str(path.relative_to(CORE))
            found[(file, block.lineno)] = (file, block.name, block.complexity)
            stack += [*getattr(block, "methods", []), *getattr(block, "closures", [])]
    return set(found.values())


def test_no_core_function_is_above_the_limit() -> None:
    over = sorted(f"{file}:{name} ({cc})" for file, name, cc in _blocks()
                  if cc > LIMIT and f"{file}:{name}" not in ALLOWED)
    assert not over, f"split these functions (complexity above {LIMIT}): {over}"


def test_the_allowed_list_names_functions_still_above_the_limit() -> None:
    above = {f"{file}:{name}" for file, name, cc in _blocks() if cc > LIMIT}
    assert above >= ALLOWED, f"remove from ALLOWED: {sorted(ALLOWED - above)}"


def test_the_counter_sees_a_complex_function() -> None:
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(LIMIT + 1))
    blocks = radon_complexity.cc_visit(f"def f(x):\n{branches}\n    return -1\n")
    assert blocks[0].complexity == LIMIT + 2
