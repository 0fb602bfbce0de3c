"""``--overwrite``'s staging folder: the earlier outputs stay until the swap, which replaces
each of them, removes those the new run did not write and keeps the user's files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gradbalance_lab._cli_common import OutputError, commit_out, prepare_out
from gradbalance_lab._out_folder import OutFolder, plan

OUTPUTS = ("report.md", "runs.csv", "plot.png", "tb")


def _earlier(out: Path) -> None:
    out.mkdir()
    (out / "report.md").write_text("old report")
    (out / "plot.png").write_bytes(b"old plot")
    (out / "tb" / "old").mkdir(parents=True)
    (out / "notes.txt").write_text("mine")


def test_fresh_or_empty_folder_is_written_in_place(tmp_path: Path) -> None:
    folder = prepare_out(tmp_path / "new", overwrite=False, outputs=OUTPUTS)
    assert not folder.staged and folder.work == tmp_path / "new"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")  # no earlier output: nothing to keep
    assert not prepare_out(tmp_path / "mine", overwrite=True, outputs=OUTPUTS).staged


def test_overwrite_writes_aside_and_touches_nothing(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    _earlier(out)
    folder = prepare_out(out, overwrite=True, outputs=OUTPUTS)
    assert folder.staged and folder.work.parent == tmp_path
    assert folder.work.name.startswith("runs.incomplete-")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "plot.png", "report.md", "tb"]
    assert (out / "report.md").read_text() == "old report"


@pytest.mark.parametrize("written", [("report.md",), ("report.md", "tb"),
                                     ("runs.csv", "plot.png", "tb"), ()])
def test_commit_replaces_exactly_the_outputs(tmp_path: Path, written: tuple[str, ...]) -> None:
    out = tmp_path / "runs"
    _earlier(out)
    folder = prepare_out(out, overwrite=True, outputs=OUTPUTS)
    for name in written:
        if name == "tb":
            (folder.work / "tb" / "new").mkdir(parents=True)
        else:
            (folder.work / name).write_text(f"new {name}")
    commit_out(folder)
    assert not folder.work.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*written, "notes.txt"])
    assert (out / "notes.txt").read_text() == "mine"
    for name in written:
        if name == "tb":
            assert [p.name for p in (out / "tb").iterdir()] == ["new"]
        else:
            assert (out / name).read_text() == f"new {name}"


def test_discard_leaves_the_earlier_outputs(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    _earlier(out)
    folder = prepare_out(out, overwrite=True, outputs=OUTPUTS)
    (folder.work / "report.md").write_text("half")
    folder.discard()
    assert not folder.work.exists()
    assert (out / "report.md").read_text() == "old report"
    assert (out / "tb" / "old").is_dir()


def test_unwritable_parent_stages_inside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "runs"
    _earlier(out)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != tmp_path and real(p, mode))
    folder = plan(out, overwrite=True, outputs=OUTPUTS)
    assert folder.work.parent == out and folder.work.name.startswith(".incomplete-")
    (folder.work / "report.md").write_text("new")
    folder.commit()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "report.md"]
    assert (out / "report.md").read_text() == "new"


def test_a_failed_move_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "runs"
    _earlier(out)
    folder = prepare_out(out, overwrite=True, outputs=OUTPUTS)
    (folder.work / "report.md").write_text("new")

    def refuse(*args: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OutputError, match=r"cannot move the new outputs in \(Permission denied\)"):
        commit_out(folder)
    assert (out / "report.md").read_text() == "old report"
    assert isinstance(folder, OutFolder) and (folder.work / "report.md").read_text() == "new"
