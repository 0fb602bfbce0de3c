"""``set_rng_state`` checks every entry before it sets any (docs/checkpoints.md): a malformed
entry raised torch's ``TypeError``, ``KeyError: 'kind'`` or a NumPy error, after the entries
before it had already moved the generators."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from gradbalance.checkpoint import get_rng_state, set_rng_state


def _draws() -> tuple[torch.Tensor, float, float]:
    return torch.rand(4), random.random(), float(np.random.rand())


def _damaged(entry: str, value: Any) -> dict[str, Any]:
    state = get_rng_state()
    state[entry] = value
    return state


_CASES: list[tuple[str, Any, str]] = [
    ("torch", "seed", "'torch' is a str"),
    ("torch", torch.zeros(10, dtype=torch.uint8), r"'torch' is a tensor of shape \(10,\)"),
    ("torch", torch.zeros(5056), "'torch' is a tensor"),
    ("python", [3, [1, 2], None], "'python' is a list"),
    ("python", 7, "'python' is a int"),
    ("numpy", {"keys": torch.zeros(624, dtype=torch.int64)}, "'numpy' is a dict"),
    ("numpy", None, "'numpy' is a NoneType"),
    ("cuda", "all", "'cuda' is a str"),
]


@pytest.mark.parametrize(("entry", "value", "text"), _CASES,
                         ids=[f"{e}-{i}" for i, (e, _, _) in enumerate(_CASES)])
def test_a_malformed_entry_is_named_and_moves_no_generator(entry: str, value: Any,
                                                            text: str) -> None:
    state = _damaged(entry, value)  # made first: the generators' state after it
    saved = get_rng_state()
    with pytest.raises(ValueError, match=text):
        set_rng_state(state)
    expected = _draws()
    set_rng_state(saved)
    got = _draws()
    set_rng_state(saved)
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


@pytest.mark.parametrize("state", [None, [], {"torch": torch.get_rng_state()}])
def test_a_state_without_its_entries_is_refused(state: Any) -> None:
    with pytest.raises(ValueError, match="pass the output of get_rng_state"):
        set_rng_state(state)


def test_a_restored_state_gives_the_same_draws() -> None:
    state = get_rng_state()
    first = _draws()
    _draws()
    set_rng_state(state)
    again = _draws()
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
