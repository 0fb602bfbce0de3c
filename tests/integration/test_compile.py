"""torch.compile under the balanced step: a compiled model or trunk gives the eager result
(``aot_eager`` bit for bit, ``inductor`` to float rounding); a graph whose backward first ran
without ``retain_graph`` needs ``donated_buffer=False``; the Gramian mode's hooks and a
compiled trunk do not mix."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._functorch.config
from torch import nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import UPGrad
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

pytestmark = pytest.mark.filterwarnings("ignore")

K, STEPS, MICRO = 3, 2, 2
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Compiled graphs are cached per code object: every test compiles afresh."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model() -> MultiTaskModel:
    torch.manual_seed(0)
    return MultiTaskModel(mlp_trunk(8, 16, 3), make_heads(16, K))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=gen), torch.randn(8, K, generator=gen))
            for _ in range(STEPS * MICRO)]


def _train(compile_: str | None, backend: str = "aot_eager", mode: str = "matrix",
           buffer_first: bool = False) -> list[torch.Tensor]:
    """STEPS balanced steps of MICRO micro-batches; ``compile_``: None, "model" or "trunk"."""
    model = _model()
    options = {"mode": "gramian", "modules": model.trunk} if mode == "gramian" else {}
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), **options) \
        if buffer_first else None
    forward: nn.Module = model
    if compile_ == "model":
        forward = torch.compile(model, backend=backend)
    elif compile_ == "trunk":
        model.trunk = torch.compile(model.trunk, backend=backend)  # type: ignore[assignment]
        if mode == "gramian":
            options["modules"] = model.trunk
    if buf is None:
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    balancer = UPGrad(K)
    batches = iter(_batches())
    for _ in range(STEPS):
        for _ in range(MICRO):
            x, y = next(batches)
            buf.backward(regression_losses(forward(x), y) / MICRO)
        buf.apply_(balancer)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("compile_", ["model", "trunk"])
def test_aot_eager_gives_the_eager_result_bit_for_bit(compile_: str) -> None:
    eager = _train(None)
    start = [p.detach() for p in _model().parameters()]
    assert all(not torch.equal(p, q) for p, q in zip(eager, start))
    for got, expected in zip(_train(compile_), eager):
        assert torch.equal(got, expected)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
                    reason="inductor on CPU needs a C++ compiler")
def test_inductor_trunk_gives_the_eager_result() -> None:
    eager = _train(None)
    for got, expected in zip(_train("trunk", backend="inductor"), eager):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)  # fused kernels


@pytest.mark.parametrize("donate", [True, False])
def test_a_graph_first_run_by_a_plain_backward(donate: bool) -> None:
    """torch compiles the backward on its first run, with donated buffers (a backward that
    runs once) when that run does not retain the graph; the balanced step's passes then
    fail, unless ``donated_buffer=False`` was set before."""
    model = _model()
    forward = torch.compile(model, backend="aot_eager")
    x, y = _batches()[0]
    with torch._functorch.config.patch(donated_buffer=donate):
        regression_losses(forward(x), y).sum().backward()  # a plain step first
        model.zero_grad(set_to_none=True)
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
        if donate:
            with pytest.raises(RuntimeError, match="donated buffers"):
                buf.backward(regression_losses(forward(x), y))
        else:
            buf.backward(regression_losses(forward(x), y))
            assert not buf.apply_(UPGrad(K)).found_inf


def test_the_step_itself_graph_breaks_at_the_task_passes() -> None:
    model = _model()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())

    def backward(x: torch.Tensor, y: torch.Tensor) -> None:
        buf.backward(regression_losses(model(x), y))

    found = torch._dynamo.explain(backward)(*_batches()[0])
    assert found.graph_break_count > 0
    assert any("autograd.grad" in str(r.reason) for r in found.break_reasons)
    forward = torch._dynamo.explain(model)(_batches()[0][0])
    assert (forward.graph_count, forward.graph_break_count) == (1, 0)


@pytest.mark.parametrize("buffer_first", [False, True])
def test_gramian_mode_refuses_a_compiled_trunk(buffer_first: bool) -> None:
    with pytest.raises(RuntimeError, match="compile"):
        _train("trunk", mode="gramian", buffer_first=buffer_first)


def test_the_benchmark_runs(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(BENCHMARKS / "compile_step.py"), "--quick",
                    "--backend", "aot_eager", "--trunks", "mlp", "--rounds", "1",
                    "--out", str(tmp_path)],
                   check=True, capture_output=True, text=True, timeout=300)
    text = (tmp_path / "compile_step-quick.txt").read_text()
    rows = [line.split("|")[1].strip() for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| variant")]
    assert rows == ["plain", "plain-compiled", "balanced", "balanced-compiled-trunk",
                    "balanced-compiled-model"]
