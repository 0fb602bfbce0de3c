"""``gramian`` mode's batched passes contracted inside the backward (``modes/_contracted.py``).

Each recorded linear layer's block of ``G Gᵀ`` is formed by a hook as its ``[K, ·]`` output
gradients arrive, and the update is one backward of ``Σₖ wₖ Lₖ``. The reference is
``matrix`` mode's loop of K ``autograd.grad`` calls: the ``[K, P]`` rows and ``wᵀG``, an
independent computation of the same update.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gradbalance import TaskClip, TaskGradBuffer, taskgrads
from gradbalance.modes import _contracted
from gradbalance_lab.models import MultiTaskModel, make_heads, regression_losses
from support.helpers import TRUNKS, Unbatchable, build, forced_buffer, grads_of
from support.perf import make_balancer


class _Gain(nn.Module):
    """A block without a linear form: an elementwise gain."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


class _Mixed(nn.Module):
    """Recorded layers (a conv, a linear called twice) among unrecorded ones (a LayerNorm, a
    bare parameter) and a linear whose weight is also used outside its call."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3, padding=1)
        self.shared = nn.Linear(12, 12)
        self.norm = nn.LayerNorm(12)
        self.gain = _Gain(12)
        self.tied = nn.Linear(12, 12)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x.unsqueeze(1))).flatten(1)[:, :12]
        h = self.gain(self.norm(torch.tanh(self.shared(torch.tanh(self.shared(h))))))
        out: Tensor = torch.tanh(self.tied(h)) + 0.1 * nn.functional.linear(h, self.tied.weight)
        return out


def _mixed(num_tasks: int, batch: int, seed: int, dtype: torch.dtype
           ) -> tuple[MultiTaskModel, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = MultiTaskModel(_Mixed(), make_heads(12, num_tasks)).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    return (model, torch.randn(batch, 6, generator=gen, dtype=dtype),
            torch.randn(batch, num_tasks, generator=gen, dtype=dtype))



def _step(buf: TaskGradBuffer, model: MultiTaskModel, x: Tensor, y: Tensor, name: str,
          split: tuple[int, ...] = (), scaler: torch.amp.GradScaler | None = None,
          clip: TaskClip | None = None) -> tuple[list[Tensor], Tensor]:
    """One step over the micro-batches of ``split`` (the whole batch by default)."""
    start, n = 0, x.shape[0]
    for size in split or (n,):
        part = slice(start, start + size)
        buf.backward(regression_losses(model(x[part]), y[part]) * (size / n), scaler=scaler)
        start += size
    stats = buf.apply_(make_balancer(name), scaler=scaler, clip=clip)
    grads = grads_of(model.shared_parameters()) + grads_of(model.head_parameters())
    model.zero_grad(set_to_none=True)
    assert stats.weights is not None
    return grads, stats.weights


def _close(actual: list[Tensor], expected: list[Tensor], rtol: float) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * max(float(e.abs().max()), 1e-3))


def _contracted_now(buf: TaskGradBuffer) -> bool:
    """Whether the step so far was contracted: its Gramian formed, no operand kept, and some
    layer's block formed inside the backward (a hook)."""
    recorder = buf._engine.recorder  # type: ignore[attr-defined]
    kept = any(block.output_grads or block.inputs or block.rows is not None
               for block in recorder.blocks)
    step = recorder.contracted
    return step is not None and not kept and any(step.calls)


def _contracted_step(model: MultiTaskModel, x: Tensor, y: Tensor, name: str,
                     force: object = None) -> tuple[list[Tensor], Tensor]:
    buf = forced_buffer(model, "gramian", "batched", force)
    buf.backward(regression_losses(model(x), y))
    assert _contracted_now(buf)
    stats = buf.apply_(make_balancer(name))
    grads = grads_of(model.shared_parameters()) + grads_of(model.head_parameters())
    model.zero_grad(set_to_none=True)
    assert stats.weights is not None
    return grads, stats.weights


@pytest.mark.parametrize("force", [None, "rows", "activations"])
@pytest.mark.parametrize("kind", TRUNKS)
def test_contracted_passes_give_matrix_modes_update(kind: str, force: str | None) -> None:
    # mlp: linear layers; cnn: convolutions; transformer: linear layers among attention and
    # LayerNorm blocks (their [K, P_b] rows) — float64, to the rounding of the two routes
    model, x, y = build(kind, batch=6, dtype=torch.float64)
    ref, ref_w = _step(forced_buffer(model, "matrix", "loop"), model, x, y, "upgrad")
    got, got_w = _contracted_step(model, x, y, "upgrad", force)
    _close(got, ref, 1e-9)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_contracted_passes_match_in_float32(kind: str) -> None:
    model, x, y = build(kind, batch=8)
    ref, ref_w = _step(forced_buffer(model, "matrix", "loop"), model, x, y, "upgrad")
    got, got_w = _contracted_step(model, x, y, "upgrad")
    _close(got, ref, 1e-4)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-4, atol=1e-5)


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(num_tasks=st.integers(2, 5), batch=st.integers(1, 6), seed=st.integers(0, 2**16),
       name=st.sampled_from(["upgrad", "mgda", "pcgrad", "dualproj"]),
       force=st.sampled_from([None, "rows", {"shared": "activations", "conv": "activations"},
                              {"shared": "activations", "conv": "rows"}]))
def test_mixed_trunk_property(num_tasks: int, batch: int, seed: int, name: str,
                              force: object) -> None:
    # recorded and unrecorded blocks, a layer called twice, a weight used outside its call
    # (that layer takes its rows from autograd, as the loop does)
    model, x, y = _mixed(num_tasks, batch, seed, torch.float64)
    ref, ref_w = _step(forced_buffer(model, "matrix", "loop"), model, x, y, name)
    got, got_w = _contracted_step(model, x, y, name, force)
    _close(got, ref, 1e-8)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-6, atol=1e-8)


def test_adversarial_scales_stay_exact() -> None:
    # tasks whose losses differ by 2**±40: each block is formed on power-of-two scaled rows
    model, x, y = _mixed(3, 5, 7, torch.float64)
    scales = torch.tensor([2.0**40, 1.0, 2.0**-40], dtype=torch.float64)

    def losses() -> Tensor:
        return regression_losses(model(x), y) * scales

    matrix = forced_buffer(model, "matrix", "loop")
    matrix.backward(losses())
    ref_stats = matrix.apply_(make_balancer("mgda"))
    ref = grads_of(model.shared_parameters())
    model.zero_grad(set_to_none=True)
    buf = forced_buffer(model, "gramian", "batched")
    buf.backward(losses())
    assert _contracted_now(buf)
    stats = buf.apply_(make_balancer("mgda"))
    _close(grads_of(model.shared_parameters()), ref, 1e-8)
    assert ref_stats.task_norms is not None and stats.task_norms is not None
    torch.testing.assert_close(stats.task_norms, ref_stats.task_norms, rtol=1e-10, atol=0)


def test_grad_scaler_and_row_clipping() -> None:
    model, x, y = _mixed(3, 6, 2, torch.float32)
    ref, ref_w = _step(forced_buffer(model, "matrix", "loop"), model, x, y, "upgrad",
                       clip=TaskClip(0.05))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    assert scaler.is_enabled()
    got, got_w = _step(forced_buffer(model, "gramian", "batched"), model, x, y, "upgrad",
                       scaler=scaler, clip=TaskClip(0.05))
    _close([g / 2.0**12 for g in got], ref, 1e-4)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-4, atol=1e-6)


def test_micro_batches_take_the_operands_from_then_on() -> None:
    # the first micro-batch was contracted: the second one makes the step take its operands
    # (from the kept graph), and the buffer keeps them from the first micro-batch thereafter
    model, x, y = build("mlp", batch=8, dtype=torch.float64)
    ref, _ = _step(forced_buffer(model, "matrix", "loop"), model, x, y, "upgrad")
    buf = forced_buffer(model, "gramian", "batched")
    for _ in range(2):
        got, _ = _step(buf, model, x, y, "upgrad", split=(3, 5))
        _close(got, ref, 1e-9)
        assert buf._engine.recorder.keep_operands  # type: ignore[attr-defined]
    buf.backward(regression_losses(model(x), y))
    assert not _contracted_now(buf)
    buf.apply_(make_balancer("upgrad"))
    _close(grads_of(model.shared_parameters()), ref[:len(model.shared_parameters())], 1e-9)


def test_a_hooked_parameter_keeps_the_operands() -> None:
    # a tensor hook on a shared parameter would also see the weighted write-back
    model, x, y = build("mlp", batch=6, dtype=torch.float64)
    ref, _ = _step(forced_buffer(model, "matrix", "loop"), model, x, y, "upgrad")
    handle = model.shared_parameters()[0].register_hook(lambda g: g)
    try:
        buf = forced_buffer(model, "gramian", "batched")
        buf.backward(regression_losses(model(x), y))
        assert buf._engine.recorder.contracted is None  # type: ignore[attr-defined]
        buf.apply_(make_balancer("upgrad"))
    finally:
        handle.remove()
    _close(grads_of(model.shared_parameters()), ref[:len(model.shared_parameters())], 1e-9)


def test_hidden_batched_gradients_take_the_operands(monkeypatch: pytest.MonkeyPatch) -> None:
    # where the hooks cannot see the [K, ·] gradients (another torch), the kept graph runs
    # the passes that keep the operands
    model, x, y = _mixed(3, 5, 3, torch.float64)
    ref, _ = _step(forced_buffer(model, "matrix", "loop"), model, x, y, "upgrad")
    monkeypatch.setattr(_contracted, "task_stack", lambda grad, k: None)
    buf = forced_buffer(model, "gramian", "batched")
    buf.backward(regression_losses(model(x), y))
    assert buf._engine.recorder.contracted is None  # type: ignore[attr-defined]
    buf.apply_(make_balancer("upgrad"))
    _close(grads_of(model.shared_parameters()), ref[:len(model.shared_parameters())], 1e-9)


def test_a_failed_batched_call_falls_back_to_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(6, 8), Unbatchable(), nn.Tanh(), nn.Linear(8, 8))
    model = MultiTaskModel(trunk, make_heads(8, 3)).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 3, dtype=torch.float64)
    ref, _ = _step(forced_buffer(model, "matrix", "loop"), model, x, y, "upgrad")
    monkeypatch.setitem(taskgrads.AUTO_PREFERENCE, "cpu", "batched")
    buf = forced_buffer(model, "gramian", "auto")
    with pytest.warns(RuntimeWarning, match="falling back to the loop"):
        got, _ = _step(buf, model, x, y, "upgrad")
    _close(got, ref, 1e-9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loop sticks, and nothing is contracted
        got, _ = _step(buf, model, x, y, "upgrad")
    _close(got, ref, 1e-9)


def test_a_failed_apply_drops_the_kept_graph() -> None:
    model, x, y = build("mlp", batch=6)
    buf = forced_buffer(model, "gramian", "batched")
    losses = regression_losses(model(x), y)
    buf.backward(losses)
    with pytest.raises(TypeError, match="needs the task-gradient rows"):
        buf.apply_(make_balancer("graddrop"))  # a matrix balancer: refused before anything
    assert all(p.grad is None for p in model.shared_parameters())
    buf.reset()
    assert buf._engine.recorder.contracted is None  # type: ignore[attr-defined]
