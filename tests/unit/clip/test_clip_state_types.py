"""A clipper's state loads only into the class that saved it (AutoClip's and TaskAutoClip's
keys coincide), unknown keys are refused, and a refused load changes nothing."""

from __future__ import annotations

import pytest
import torch

from gradbalance.clip import AutoClip, TaskAutoClip


def _warm(clipper: AutoClip | TaskAutoClip) -> None:
    """A few clipped steps, so the history holds numbers."""
    torch.manual_seed(0)
    if isinstance(clipper, TaskAutoClip):
        for _ in range(3):
            clipper(torch.randn(2, 5))
        return
    layer = torch.nn.Linear(3, 2)
    for _ in range(3):
        layer.zero_grad()
        layer(torch.randn(4, 3)).sum().backward()
        clipper(layer.parameters())


@pytest.mark.parametrize(("saver", "loader"), [(AutoClip, TaskAutoClip),
                                               (TaskAutoClip, AutoClip)])
def test_state_of_one_auto_clipper_is_refused_by_the_other(saver: type, loader: type) -> None:
    source = saver(history_size=8)
    _warm(source)
    target = loader(history_size=8)
    before = target.state_dict()
    with pytest.raises(ValueError, match=f"saved by a {saver.__name__}"):
        target.load_state_dict(source.state_dict())
    assert target.state_dict() == before


@pytest.mark.parametrize("cls", [AutoClip, TaskAutoClip])
def test_unknown_key_and_untagged_state_are_refused(cls: type) -> None:
    source = cls(history_size=8)
    _warm(source)
    state = source.state_dict()
    assert state["_type"] == cls.__name__
    with pytest.raises(ValueError, match="unexpected keys"):
        cls(history_size=8).load_state_dict({**state, "targets": None})
    untagged = {k: v for k, v in state.items() if k != "_type"}  # no class named
    fresh = cls(history_size=8)
    before = fresh.state_dict()
    with pytest.raises(ValueError, match="does not name the class"):
        fresh.load_state_dict(untagged)
    assert fresh.state_dict() == before  # nothing loaded (a fresh clipper: no history yet)
