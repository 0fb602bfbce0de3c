"""The one recorder behind GhostNorms and the per-sample Gramian
(``gradbalance.clip._per_sample_record``): the same misuse is refused by both with the same
text, naming the owner, and each drops its records."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.clip import GhostNorms


def _refusals(misuse: Callable[[nn.Linear, Tensor], Tensor]) -> list[str]:
    """The messages of GhostNorms and of the buffer for the same forward ``misuse``."""
    messages = []
    for owner in ("ghost", "buffer"):
        torch.manual_seed(0)
        model = nn.Linear(3, 3)
        ghost = GhostNorms(model) if owner == "ghost" else None
        buf = TaskGradBuffer(model.parameters(), modules=model, batch_dim=0)
        losses = misuse(model, torch.randn(4, 3))
        with pytest.raises((RuntimeError, ValueError)) as error:
            if ghost is not None:
                ghost.norms(losses)
            else:
                buf.backward(losses)
        messages.append(str(error.value))
        assert all(p.grad is None for p in model.parameters())
    return messages


def test_an_unrecorded_use_has_one_text() -> None:
    ghost, buffer = _refusals(lambda m, x: nn.functional.linear(m(x), m.weight).sum(1))
    for text, owner in ((ghost, "GhostNorms"), (buffer, "the buffer")):
        assert text.startswith("parameter 'weight' is used 2 times on the losses' graph but "
                               f"its layer(s) recorded 1 calls, so {owner} misses part")
        assert "not F.linear(x, layer.weight)" in text


def test_a_tensor_hook_has_one_text() -> None:
    def hooked(m: nn.Linear, x: Tensor) -> Tensor:
        m.weight.register_hook(lambda g: g)
        return m(x).sum(1)

    ghost, buffer = _refusals(hooked)
    assert ghost.replace("GhostNorms", "X").split(". Call")[0] == buffer.replace(
        "the buffer", "X").split(". Call")[0]
    assert "has a tensor hook" in ghost


def test_an_in_place_output_has_one_text() -> None:
    ghost, buffer = _refusals(lambda m, x: torch.relu_(m(x)).sum(1))
    assert ghost.split(", or ")[0] == buffer.split(", or ")[0]
    assert "layer '' (Linear) was modified in place" in ghost
