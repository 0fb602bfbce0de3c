"""The task-gradient passes chosen by measurement: order of runs, the winner kept and saved."""

from __future__ import annotations

import warnings

import pytest
import torch

from gradbalance import TaskGradBuffer, task_gradients, taskgrads
from gradbalance.balancers import Sum
from gradbalance.modes import _measure
from support.helpers import ItemInBackward, build, losses_of


def _fake_clock(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, float]) -> list[str]:
    """Run the real passes but report ``seconds[passes]``; return the order of runs."""
    calls: list[str] = []
    real = _measure.timed_run

    def timed(roots, layout, out, passes, reached=None):  # type: ignore[no-untyped-def]
        calls.append(passes)
        real(roots, layout, out, passes, reached)
        return seconds[passes]

    monkeypatch.setattr(_measure, "timed_run", timed)
    return calls


def _matrix_after_backward(buf: TaskGradBuffer, model, x, y) -> torch.Tensor:  # type: ignore[no-untyped-def]
    buf.backward(losses_of(model, x, y))
    assert buf.matrix is not None
    return buf.matrix.clone()


@pytest.mark.parametrize(("faster", "expected_calls"), [
    ("batched", ["batched", "loop", "batched", "loop", "batched"]),
    ("loop", ["batched", "loop", "batched", "loop"]),
])
def test_measure_keeps_the_faster_strategy(monkeypatch: pytest.MonkeyPatch, faster: str,
                                           expected_calls: list[str]) -> None:
    seconds = {"batched": 2.0, "loop": 1.0} if faster == "loop" else {"batched": 1.0, "loop": 2.0}
    calls = _fake_clock(monkeypatch, seconds)
    model, x, y = build("mlp", num_tasks=3)
    trunk = list(model.trunk.parameters())
    buf = TaskGradBuffer(trunk, model.head_parameters(), passes="measure")
    matrix = _matrix_after_backward(buf, model, x, y)
    assert calls == expected_calls  # the last run is the winner's: G is its result
    assert buf.state_dict()["passes"] == faster
    reference = task_gradients(losses_of(model, x, y), trunk, passes="loop")
    torch.testing.assert_close(matrix, reference, rtol=1e-5, atol=1e-7)
    buf.apply_(Sum())
    # Later steps use the choice without timing anything.
    _matrix_after_backward(buf, model, x, y)
    assert len(calls) == len(expected_calls)


def test_auto_measures_on_a_device_without_a_preference(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_clock(monkeypatch, {"batched": 1.0, "loop": 2.0})
    monkeypatch.delitem(taskgrads.AUTO_PREFERENCE, "cpu")
    model, x, y = build("mlp", num_tasks=2)
    buf = TaskGradBuffer(model.trunk.parameters(), model.head_parameters())
    _matrix_after_backward(buf, model, x, y)
    assert calls and buf.state_dict()["passes"] == "batched"


def test_auto_on_cpu_does_not_measure(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_clock(monkeypatch, {"batched": 1.0, "loop": 2.0})
    model, x, y = build("mlp", num_tasks=2)
    buf = TaskGradBuffer(model.trunk.parameters(), model.head_parameters())
    _matrix_after_backward(buf, model, x, y)
    assert calls == [] and "passes" not in buf.state_dict()


def test_micro_batches_accumulate_after_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_clock(monkeypatch, {"batched": 1.0, "loop": 2.0})
    model, x, y = build("mlp", num_tasks=3, batch=8)
    trunk = list(model.trunk.parameters())
    buf = TaskGradBuffer(trunk, model.head_parameters(), passes="measure")
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        buf.backward(losses_of(model, xs, ys) / 2)
    assert buf.matrix is not None
    reference = task_gradients(losses_of(model, x, y), trunk, passes="loop")
    torch.testing.assert_close(buf.matrix, reference, rtol=1e-5, atol=1e-7)


def test_resumed_buffer_uses_the_saved_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_clock(monkeypatch, {"batched": 1.0, "loop": 2.0})
    model, x, y = build("mlp", num_tasks=2)
    fresh = TaskGradBuffer(model.trunk.parameters(), model.head_parameters(), passes="measure")
    fresh.load_state_dict({"update_every": 1, "step": 0, "weights": None, "passes": "loop"})
    _matrix_after_backward(fresh, model, x, y)
    assert calls == [] and fresh.state_dict()["passes"] == "loop"
    other = TaskGradBuffer(model.trunk.parameters(), model.head_parameters(), passes="measure")
    with pytest.raises(ValueError, match="Invalid state_dict: passes='fast'"):  # between steps
        other.load_state_dict({"update_every": 1, "step": 0, "weights": None,
                               "passes": "fast"})


def test_no_batching_rule_measures_once_then_sticks_to_the_loop() -> None:
    w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)

    def losses() -> list[torch.Tensor]:
        h = ItemInBackward.apply(w)
        return [(h**2).sum(), h.sum()]

    buf = TaskGradBuffer([w], passes="measure")
    with pytest.warns(RuntimeWarning, match="falling back"):
        buf.backward(losses())
    assert buf.matrix is not None
    torch.testing.assert_close(buf.matrix, torch.stack([8 * w.detach(), torch.full((3,), 2.0)]))
    assert buf.state_dict()["passes"] == "loop"
    buf.apply_(Sum())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second failed batched call
        buf.backward(losses())


def test_real_measurement_gives_the_task_gradients() -> None:
    model, x, y = build("cnn", num_tasks=3)
    trunk = list(model.trunk.parameters())
    buf = TaskGradBuffer(trunk, model.head_parameters(), passes="measure")
    matrix = _matrix_after_backward(buf, model, x, y)
    assert buf.state_dict()["passes"] in ("loop", "batched")
    reference = task_gradients(losses_of(model, x, y), trunk, passes="loop")
    torch.testing.assert_close(matrix, reference, rtol=1e-5, atol=1e-6)
