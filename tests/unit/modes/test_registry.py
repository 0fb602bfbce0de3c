"""One table of mode names: the buffer's modes, the ranks' agreement check and the errors all
read :data:`gradbalance.modes.ENGINES`."""

from __future__ import annotations

import typing
import zlib

import pytest
import torch

from gradbalance import TaskGradBuffer
from gradbalance import distributed as dist_module
from gradbalance.modes import ENGINES, MODES, Mode, sharded_modes

#: Where shipping a mode is written down.
HOW_TO = 'docs/ARCHITECTURE.md, "How to add a gradient mode"'


def test_the_names_are_the_mode_literal() -> None:
    shipped = ("matrix", "gramian", "auto", "features")
    assert MODES == typing.get_args(Mode) == shipped, (
        f"the Mode literal {typing.get_args(Mode)} is not this test's list {shipped}: a shipped "
        f"mode goes in the literal, in ENGINES, and in this list ({HOW_TO})")
    assert tuple(ENGINES) == MODES, (
        f"ENGINES {tuple(ENGINES)} and the Mode literal {MODES} differ: a shipped mode is in both, "
        f"in the same order ({HOW_TO})")
    assert sharded_modes() == ["matrix", "features"], (
        f"sharded_modes() is {sharded_modes()}: an engine declaring shardable = True (or "
        f"inheriting it, as a subclass of MatrixMode does) runs on a sharded trunk; add it "
        f"here or set shardable = False ({HOW_TO})")
    hooking = [name for name, engine in ENGINES.items() if engine.hooks_forward]
    assert hooking == ["gramian", "auto"], (
        f"the engines declaring hooks_forward = True are {hooking}: the modes that hook the "
        f"forward of modules are gramian and auto ({HOW_TO})")
    for name, engine in ENGINES.items():
        assert engine.mode == name, (
            f"ENGINES[{name!r}].mode is {engine.mode!r}: an engine's mode is its key ({HOW_TO})")


@pytest.mark.parametrize("other", ["matrix", "gramian", "auto", "features"])
def test_a_disagreement_names_every_mode(other: str) -> None:
    """Each rank sends the CRC-32 of its mode; the other ranks read it back as the name
    (``"auto"`` was once missing and read as ``<unknown, code …>``)."""
    code = zlib.crc32(other.encode())
    for local in MODES:
        phrase = dist_module._reads("mode", code, {"mode": local, "dtype": "torch.float32"},
                                    tuple(ENGINES))
        assert phrase == f"has mode='{other}'"


def test_an_unknown_mode_lists_the_table() -> None:
    trunk = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="Invalid mode: 'bogus'") as info:
        TaskGradBuffer(list(trunk.parameters()), mode="bogus")  # type: ignore[arg-type]
    assert "matrix, gramian, auto, features" in str(info.value)


@pytest.mark.parametrize("base", ["matrix", "gramian", "features"])
def test_a_subclassed_engine_reports_its_own_name(base: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A mode registered as a subclass of a shipped engine names itself in ``StepStats.mode``
    (the engines once wrote their parent's name)."""
    from gradbalance.balancers import Mean

    parent = ENGINES[base]
    child = type("CopyMode", (parent,), {"mode": f"{base}_copy"})
    monkeypatch.setitem(ENGINES, f"{base}_copy", child)
    torch.manual_seed(0)
    trunk = torch.nn.Linear(3, 4)
    heads = torch.nn.ModuleList(torch.nn.Linear(4, 1) for _ in range(2))
    buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()),
                         mode=f"{base}_copy", modules=trunk if base == "gramian" else None)
    feats = trunk(torch.randn(5, 3))
    losses = torch.stack([h(feats).pow(2).mean() for h in heads])
    if base == "features":
        buf.backward(losses, features=feats)
    else:
        buf.backward(losses)
    assert buf.apply_(Mean()).mode == f"{base}_copy"
