"""``.ci/gpu_check.sh`` on a machine without CUDA: one line, exit 0, nothing installed.

The script runs with a ``PATH`` that holds only the tools it needs before its first check
(and, for the second case, an ``nvidia-smi`` that lists no GPU), so the result does not
depend on what this machine has.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "gpu_check.sh"
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="bash is not installed")


def _run(tools: Path, *args: str) -> subprocess.CompletedProcess[str]:
    for tool in ("dirname", "timeout", "grep"):
        found = shutil.which(tool)
        assert found is not None, f"{tool} is not installed"
        (tools / tool).symlink_to(found)
    assert BASH is not None
    return subprocess.run([BASH, str(SCRIPT), *args], env={"PATH": str(tools)},
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_script_parses() -> None:
    assert BASH is not None
    subprocess.run([BASH, "-n", str(SCRIPT)], check=True, timeout=60)


def test_without_nvidia_smi_it_says_so_and_exits_0(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = _run(tmp_path, str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "gpu-check: no CUDA device here (nvidia-smi not found); nothing to run\n"
    assert not out.exists()


def test_without_a_listed_gpu_it_says_so_and_exits_0(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
    smi.chmod(0o755)
    out = tmp_path / "out"
    done = _run(tmp_path, str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout == ("gpu-check: no CUDA device here (nvidia-smi -L lists none); "
                           "nothing to run\n")
    assert not out.exists()
