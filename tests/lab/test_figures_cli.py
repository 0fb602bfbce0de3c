"""``gradbalance figures`` end to end: the PNG and the report, missing pieces, missing extra."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gradbalance.balancers import BALANCERS
from gradbalance_lab.cli import main
from gradbalance_lab.figures import run_one
from gradbalance_lab.figures._common import pyplot


def test_cli_writes_png_and_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "figs"
    assert main(["figures", "--quick", "--only", "clipping", "--out", str(out)]) == 0
    png = out / "clipping.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text(encoding="utf-8")
    assert "returns 50" in report and "| met |" in report and "NOT met" not in report
    assert "![clipping](clipping.png)" in report
    printed = capsys.readouterr().out
    assert "returns 50" in printed and "measured: 50" in printed
    assert not (out / "momentum.png").exists()  # --only ran one figure


def test_cli_rejects_unknown_figure(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["figures", "--only", "nope", "--out", str(tmp_path)])


def test_missing_balancer_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(BALANCERS, "pcgrad")
    entry = run_one("pcgrad_momentum", quick=True, out=None, draw=False)
    assert entry["missing"] is not None and "pcgrad" in entry["missing"]
    assert entry["claims"] == [] and entry["result"] is None


def test_missing_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"gradbalance\[plot\]"):
        pyplot()
