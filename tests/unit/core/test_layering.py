"""The core never imports the lab: importing every core module leaves ``gradbalance_lab``
(and the lab's optional packages) out of ``sys.modules``, and no core source names it."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import gradbalance

CORE = Path(gradbalance.__file__).parent
#: The entry point ``python -m gradbalance`` runs the lab's command line by design.
ENTRY_POINTS = {"__main__.py"}


def _core_modules() -> list[str]:
    return sorted(
        info.name for info in pkgutil.walk_packages([str(CORE)], prefix="gradbalance.")
        if not info.name.endswith("__main__")
    )


def test_no_core_source_imports_the_lab() -> None:
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        if path.name in ENTRY_POINTS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            offenders += [f"{path.relative_to(CORE)}: {n}" for n in names
                          if n.split(".")[0] == "gradbalance_lab"]
    assert offenders == []


def test_importing_every_core_module_leaves_the_lab_out() -> None:
    modules = _core_modules()
    assert len(modules) > 40  # every subpackage was walked
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as error:\n"
        "        if error.name not in ('lightning', 'pytorch_lightning'):\n"
        "            raise\n"
        "lab = sorted(m for m in sys.modules if m.split('.')[0] == 'gradbalance_lab')\n"
        "plots = sorted(m for m in ('matplotlib', 'sklearn') if m in sys.modules)\n"
        "print(lab, plots)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr
