"""What ``compare`` says a step costs: interleaved timing against the plain step, the loss
weightings' one-pass path, and every missing extra named at once."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import gradbalance as gb
from gradbalance_lab import _mtl_timing
from gradbalance_lab._mtl_methods import Method
from gradbalance_lab._mtl_step import MethodStep
from gradbalance_lab.cli import main


class FakeClock:
    """``time.perf_counter`` that moves only when a step says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_interleaved_rounds_and_ratios(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(_mtl_timing.time, "perf_counter", clock)
    calls: list[tuple[str, int]] = []
    cost = {"plain": 1.0, "a": 3.0, "b": 0.5}

    def make_step(label: str, seed: int):
        def step() -> None:
            calls.append((label, seed))
            # seed 1's machine is twice as slow: the ratios stay those of its own plain step
            clock.now += cost[label] * (1 + seed) / 1000
        return step

    got = _mtl_timing.time_interleaved(make_step, ["plain", "a", "b"], [0, 1],
                                       reference="plain", rounds=4, warmup=1)
    assert got["plain"].ratio == 1.0
    assert got["a"].ratio == pytest.approx(3.0) and got["b"].ratio == pytest.approx(0.5)
    assert got["a"].ms == pytest.approx(4.5)  # median of 3 ms (seed 0) and 6 ms (seed 1)
    # every round holds every (method, seed), the methods in a rotated order
    rounds = [calls[i:i + 6] for i in range(0, len(calls), 6)]
    assert len(rounds) == 5 and all(sorted(r) == sorted(rounds[0]) for r in rounds)
    assert [r[0][0] for r in rounds] == ["plain", "a", "b", "plain", "a"]


def test_a_failing_step_is_nan_the_others_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr(_mtl_timing.time, "perf_counter", clock)

    def make_step(label: str, seed: int):
        def step() -> None:
            if label == "bad":
                raise RuntimeError("solver")
            clock.now += 0.002 if label == "a" else 0.001
        return step

    got = _mtl_timing.time_interleaved(make_step, ["plain", "bad", "a"], [0], reference="plain",
                                       rounds=3, warmup=0)
    assert got["bad"].ms != got["bad"].ms and got["bad"].ratio != got["bad"].ratio  # NaN
    assert got["a"].ratio == pytest.approx(2.0)
    with pytest.raises(ValueError, match="Invalid reference: 'x'"):
        _mtl_timing.time_interleaved(make_step, ["a"], [0], reference="x")


@pytest.mark.parametrize("key", ["uncertainty", "dwa", "gradnorm"])
def test_a_loss_weighting_takes_its_one_pass_path(key: str) -> None:
    torch.manual_seed(0)
    trunk, heads = nn.Linear(4, 3), nn.ModuleList(nn.Linear(3, 1) for _ in range(2))
    x = torch.randn(8, 4)

    def losses() -> torch.Tensor:
        feats = trunk(x)
        return torch.stack([h(feats).square().mean() * (k + 1) for k, h in enumerate(heads)])

    make = {"gradnorm": lambda: gb.get_weighting(key, num_tasks=2, layer=trunk)}.get(
        key, lambda: gb.get_weighting(key, num_tasks=2))
    step = MethodStep(Method("weighting", key), list(trunk.parameters()),
                      list(heads.parameters()), 2, 0, lambda _: make())
    assert step.buf is None  # no TaskGradBuffer: no K backward passes over the trunk
    assert step.backward(losses()) is None
    got = [p.grad.clone() for p in trunk.parameters()]
    # by hand: the gradient of the weighted sum, from a fresh weighting in the same state
    for p in [*trunk.parameters(), *heads.parameters()]:
        p.grad = None
    make()(losses()).sum().backward()
    for a, p in zip(got, trunk.parameters()):
        torch.testing.assert_close(a, p.grad)


def test_the_plain_step_is_sum_backward() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    out = model(torch.ones(1, 3))[0]
    step = MethodStep(Method("plain", "plain"), [model.weight], [model.bias], 2, 0, lambda _: None)
    assert step.backward(torch.stack([out[0], 2 * out[1]])) is None
    torch.testing.assert_close(model.bias.grad, torch.tensor([1.0, 2.0]))


def test_every_missing_extra_in_one_message(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    for module in ("sklearn", "tensorboard", "matplotlib"):
        monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    assert main(["compare", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("gradbalance compare: error: ")
    for text in ("needs scikit-learn (pip install gradbalance[data])",
                 "needs tensorboard (pip install gradbalance[tensorboard], or pass "
                 "--no-tensorboard)", "needs matplotlib (pip install gradbalance[plot], or "
                 "pass --no-plot)", 'pip install "gradbalance[data,tensorboard,plot]" '
                 '(or "gradbalance[all]")'):
        assert text in err, err
    assert not (tmp_path / "out").exists()
