"""Checks a core-only install (``pip install .``, no extras) in a fresh venv.

Run with that venv's python from a folder outside the source tree (``make check-install``):
the package must come from site-packages, one balanced step must match PCGrad computed by
hand, the optional packages must be absent, and the command line must say which extra a
command needs.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch

import gradbalance
from gradbalance.balancers import PCGrad, Sum

OPTIONAL = ("matplotlib", "tensorboard", "sklearn", "tqdm", "lightning", "scipy",
            "transformers", "accelerate")
TIMEOUT = 120  # seconds, per command-line call


def check_installed_copy() -> None:
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(gradbalance.__file__).resolve()
    assert site in where.parents, f"gradbalance imported from {where}, not from {site}"
    assert (where.parent / "py.typed").is_file(), "py.typed is not installed"
    installed = importlib.metadata.version("gradbalance")
    assert gradbalance.__version__ == installed, (gradbalance.__version__, installed)
    assert importlib.metadata.metadata("gradbalance")["License-Expression"] == "MIT"


def _model() -> tuple[torch.nn.Linear, torch.nn.ModuleList, torch.Tensor]:
    trunk = torch.nn.Linear(3, 2, bias=False, dtype=torch.float64)
    heads = torch.nn.ModuleList(
        [torch.nn.Linear(2, 1, bias=False, dtype=torch.float64) for _ in range(2)])
    with torch.no_grad():
        trunk.weight.copy_(torch.tensor([[1.0, 0.5, -0.5], [0.2, -1.0, 0.3]]))
        heads[0].weight.copy_(torch.tensor([[1.0, 0.4]]))
        heads[1].weight.copy_(torch.tensor([[-0.5, -1.0]]))  # task gradients at ~118°
    x = torch.tensor([[1.0, 2.0, -1.0], [0.5, -0.3, 2.0], [-1.0, 0.7, 0.4]],
                     dtype=torch.float64)
    return trunk, heads, x


def _losses(trunk: torch.nn.Linear, heads: torch.nn.ModuleList, x: torch.Tensor
            ) -> list[torch.Tensor]:
    feats = trunk(x)
    return [(head(feats) - 1.0).pow(2).mean() for head in heads]


def check_balanced_step() -> None:
    # the two task gradients of the trunk, each by its own autograd call
    trunk, heads, x = _model()
    g1, g2 = (torch.autograd.grad(loss, trunk.weight, retain_graph=True)[0].reshape(-1)
              for loss in _losses(trunk, heads, x))
    dot = float(g1 @ g2)
    assert dot < 0, f"the test gradients must conflict (g1·g2 = {dot})"
    # PCGrad with two tasks: each gradient loses its component along the other; then the sum
    expected_pcgrad = (g1 - dot / float(g2 @ g2) * g2) + (g2 - dot / float(g1 @ g1) * g1)
    for balancer, expected in ((PCGrad(), expected_pcgrad), (Sum(), g1 + g2)):
        trunk, heads, x = _model()
        gradbalance.balanced_backward(torch.stack(_losses(trunk, heads, x)), balancer,
                                      shared_params=trunk.parameters(),
                                      head_params=heads.parameters())
        got = trunk.weight.grad
        assert got is not None, f"{type(balancer).__name__}: trunk.weight.grad is None"
        assert torch.allclose(got.reshape(-1), expected, rtol=1e-9, atol=1e-12), (
            f"{type(balancer).__name__}: trunk grad {got.reshape(-1).tolist()}, "
            f"expected {expected.tolist()}")
    assert not torch.allclose(expected_pcgrad, g1 + g2)  # the projection changed something


def check_no_extras() -> None:
    present = [name for name in OPTIONAL if importlib.util.find_spec(name) is not None]
    assert present == [], f"a core-only install has optional packages: {present}"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).with_name("gradbalance")
    return subprocess.run([str(script), *args], capture_output=True, text=True,
                          timeout=TIMEOUT, check=False)


def check_command_line() -> None:
    expected = f"gradbalance {gradbalance.__version__} (torch {torch.__version__})"
    for argv in ([str(Path(sys.executable).with_name("gradbalance"))],
                 [sys.executable, "-m", "gradbalance"]):
        out = subprocess.run([*argv, "--version"], capture_output=True, text=True,
                             timeout=TIMEOUT, check=False)
        assert out.returncode == 0 and out.stdout.strip() == expected, out
    figures = _cli("figures", "--quick", "--out", "figures-out")
    assert figures.returncode != 0, figures
    assert "pip install gradbalance[plot]" in figures.stderr, figures.stderr
    assert "Traceback" not in figures.stderr, figures.stderr
    compare = _cli("compare", "--no-tensorboard", "--no-plot", "--out", "compare-out")
    assert compare.returncode != 0, compare
    assert "pip install gradbalance[data]" in compare.stderr, compare.stderr
    assert "Traceback" not in compare.stderr, compare.stderr


def main() -> None:
    check_installed_copy()
    check_balanced_step()
    check_no_extras()
    check_command_line()
    print(f"install smoke: ok (gradbalance {gradbalance.__version__} from "
          f"{Path(gradbalance.__file__).parent}, torch {torch.__version__})")


if __name__ == "__main__":
    main()
