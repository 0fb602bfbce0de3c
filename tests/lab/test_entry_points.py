"""The ways to start the command line: ``gradbalance``, ``python -m gradbalance`` and
``python -m gradbalance_lab`` run the same parser; ``--version``; a missing extra's message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradbalance
import gradbalance_lab.figures
from gradbalance_lab.cli import main

TIMEOUT = 120  # seconds per subprocess
SCRIPT = Path(sys.executable).with_name("gradbalance")
VERSION = f"gradbalance {gradbalance.__version__} (torch {torch.__version__})"


def _launchers() -> list[list[str]]:
    launchers = [[sys.executable, "-m", "gradbalance"], [sys.executable, "-m", "gradbalance_lab"]]
    if SCRIPT.is_file():  # the console script of an installed (or editable) gradbalance
        launchers.append([str(SCRIPT)])
    return launchers


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT, check=False)


@pytest.mark.parametrize("launcher", _launchers(), ids=lambda argv: " ".join(argv[-2:]))
def test_version_from_every_launcher(launcher: list[str]) -> None:
    out = _run([*launcher, "--version"])
    assert out.returncode == 0, out.stderr
    assert out.stdout == VERSION + "\n"


def test_every_launcher_runs_the_same_parser() -> None:
    helps = {" ".join(argv[-2:]): _run([*argv, "--help"]) for argv in _launchers()}
    for name, out in helps.items():
        assert out.returncode == 0, (name, out.stderr)
        for command in ("compare", "train", "figures", "--version"):
            assert command in out.stdout, (name, command)
    assert len({out.stdout for out in helps.values()}) == 1, helps


def test_version_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == VERSION


def test_importing_the_core_entry_module_leaves_the_lab_out() -> None:
    code = ("import sys, gradbalance.__main__\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gradbalance_lab'))\n")
    out = _run([sys.executable, "-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_missing_extra_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert main(["figures", "--quick", "--only", "clipping", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradbalance figures: error: ")
    assert "needs matplotlib" in err and "pip install gradbalance[plot]" in err
    assert "--no-plot" in err  # and how to do without it


def test_other_import_errors_propagate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: object) -> int:
        raise ImportError("cannot import name 'thing' from 'somewhere'")

    monkeypatch.setattr(gradbalance_lab.figures, "run", broken)
    with pytest.raises(ImportError, match="cannot import name 'thing'"):
        main(["figures", "--out", str(tmp_path)])
