"""Every registered balancer states its cost in the number of tasks K in its docstring."""

from __future__ import annotations

import pytest

from gradbalance.balancers import BALANCERS


@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_the_docstring_states_the_cost_in_k(name: str) -> None:
    doc = BALANCERS[name].__doc__ or ""
    rule = ("a balancer's docstring states its cost in K, e.g. 'Cost in K: ``O(K)`` weights, "
            "the sum ``O(KP)``.' (docs/ARCHITECTURE.md, \"Extension contract\", \"Documented\")")
    assert "Cost in K" in doc or "Cost:" in doc, f"{name}: no 'Cost in K' in its docstring; {rule}"
    assert "O(" in doc, f"{name}: the cost has no O(...) term; {rule}"
