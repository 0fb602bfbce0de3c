"""``gramian`` mode over several micro-batches: the full batch's Gramian and update.

The reference is ``matrix`` mode on the whole batch: it sums the ``[K, P]`` rows and never
settles anything, so it is an independent computation of the same update.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskAutoClip, TaskClip, TaskGradBuffer, TaskValueClip
from gradbalance_lab.models import MultiTaskModel, make_heads, regression_losses
from support.helpers import TRUNKS, build, grads_of, optimizer_step
from support.perf import make_balancer

SPLITS = [(8,), (3, 5), (2, 1, 5)]


def _step(model: MultiTaskModel, x: Tensor, y: Tensor, name: str, mode: str,
          split: tuple[int, ...], scaler: torch.amp.GradScaler | None = None,
          passes: str = "auto") -> tuple[list[Tensor], list[Tensor], Tensor]:
    """One step over the micro-batches of ``split``, each loss weighted by its share."""
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                         passes=passes,  # type: ignore[arg-type]
                         **({"modules": model.trunk} if mode == "gramian" else {}))
    start = 0
    for size in split:
        part = slice(start, start + size)
        losses = regression_losses(model(x[part]), y[part]) * (size / x.shape[0])
        buf.backward(losses, scaler=scaler)
        start += size
    stats = buf.apply_(make_balancer(name), scaler=scaler)
    trunk, heads = grads_of(model.shared_parameters()), grads_of(model.head_parameters())
    model.zero_grad(set_to_none=True)
    assert stats.weights is not None
    return trunk, heads, stats.weights


def _close(actual: list[Tensor], expected: list[Tensor], rtol: float) -> None:
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * float(e.abs().max()))


@pytest.mark.parametrize("split", SPLITS[1:])
@pytest.mark.parametrize("name", ["pcgrad", "mgda", "upgrad"])
@pytest.mark.parametrize("kind", TRUNKS)
def test_micro_batches_give_the_full_batch_update(kind: str, name: str,
                                                  split: tuple[int, ...]) -> None:
    # Linear blocks (mlp), conv blocks (cnn: settled rows) and attention with LayerNorm
    # (transformer: both kinds) — every block kind the recorder settles.
    model, x, y = build(kind, batch=8, dtype=torch.float64)
    trunk_ref, heads_ref, weights_ref = _step(model, x, y, name, "matrix", SPLITS[0])
    trunk, heads, weights = _step(model, x, y, name, "gramian", split)
    _close(trunk, trunk_ref, 1e-9)
    _close(heads, heads_ref, 1e-9)
    torch.testing.assert_close(weights, weights_ref, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_batched_passes_give_the_same_update(kind: str) -> None:
    # one vmapped call for the K passes (linear outputs and the other blocks' parameters)
    model, x, y = build(kind, batch=8, dtype=torch.float64)
    trunk_ref, heads_ref, _ = _step(model, x, y, "upgrad", "matrix", SPLITS[0], passes="loop")
    trunk, heads, _ = _step(model, x, y, "upgrad", "gramian", (3, 5), passes="batched")
    _close(trunk, trunk_ref, 1e-9)
    _close(heads, heads_ref, 1e-9)


class _SharedLayerTrunk(nn.Module):
    """A linear layer called twice per forward, a LayerNorm and a conv: every block kind."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3, padding=1)
        self.shared = nn.Linear(12, 12)
        self.norm = nn.LayerNorm(12)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.conv(x.unsqueeze(1))).flatten(1)[:, :12]
        return self.norm(torch.tanh(self.shared(torch.tanh(self.shared(h)))))


def test_micro_batches_with_a_layer_called_twice_and_a_grad_scaler() -> None:
    torch.manual_seed(4)
    model = MultiTaskModel(_SharedLayerTrunk(), make_heads(12, 3))
    x, y = torch.randn(7, 6), torch.randn(7, 3)
    trunk_ref, heads_ref, weights_ref = _step(model, x, y, "upgrad", "matrix", (7,))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert scaler.is_enabled()
    trunk, heads, weights = _step(model, x, y, "upgrad", "gramian", (4, 3), scaler=scaler)
    _close([g / 2.0**10 for g in trunk], trunk_ref, 1e-5)
    _close([g / 2.0**10 for g in heads], heads_ref, 1e-5)
    torch.testing.assert_close(weights, weights_ref, rtol=1e-5, atol=1e-7)


def test_an_earlier_micro_batch_graph_is_released() -> None:
    model, x, y = build("mlp", batch=8)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="gramian",
                         modules=model.trunk)
    first = model.trunk(x[:4])  # the trunk's last block output: recorded by the hooks
    buf.backward(regression_losses([h(first) for h in model.heads], y[:4]))
    alive = weakref.ref(first)
    del first
    buf.backward(regression_losses(model(x[4:]), y[4:]))  # settles the first micro-batch
    gc.collect()
    assert alive() is None
    buf.apply_(make_balancer("upgrad"))


def test_reused_steps_keep_no_records() -> None:
    model, x, y = build("mlp", batch=8)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="gramian",
                         modules=model.trunk, update_every=4)
    recorder = buf._engine.recorder
    balancer = make_balancer("mgda")  # one object: a reuse step refuses another
    for _ in range(3):
        for part in (slice(0, 4), slice(4, 8)):
            buf.backward(regression_losses(model(x[part]), y[part]) / 2)
        buf.apply_(balancer)
        assert all(not block.calls and block.rows is None for block in recorder.blocks)


def _clipped_steps(kind: str, mode: str, clip_of: Callable[[], Any], steps: int = 3,
                   scaler: torch.amp.GradScaler | None = None) -> tuple[list[Tensor], list[Any]]:
    """``steps`` SGD steps of UPGrad with per-task clipping; parameters and the stats."""
    model, x, y = build(kind, batch=8, dtype=torch.float64 if scaler is None else torch.float32)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                         **({"modules": model.trunk} if mode == "gramian" else {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    balancer, clip, stats = make_balancer("upgrad"), clip_of(), []
    for _ in range(steps):
        for part in (slice(0, 3), slice(3, 8)):
            share = (part.stop - part.start) / 8
            buf.backward(regression_losses(model(x[part]), y[part] * 4) * share, scaler=scaler)
        stats.append(buf.apply_(balancer, scaler=scaler, clip=clip))
        optimizer_step(opt, scaler)
    return [p.detach().clone() for p in model.parameters()], stats


@pytest.mark.parametrize("clip_of", [lambda: TaskClip(0.5), lambda: TaskAutoClip(50.0, 10)],
                         ids=["TaskClip", "TaskAutoClip"])
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_norm_clipping_on_the_gramian_equals_clipping_the_rows(kind: str,
                                                               clip_of: Callable[[], Any]) -> None:
    # matrix mode scales the rows of [K, P]; gramian mode scales G Gᵀ by cᵢcⱼ and the
    # written weights by c — the same step, and the same pre-clip norms
    params_m, stats_m = _clipped_steps(kind, "matrix", clip_of)
    params_g, stats_g = _clipped_steps(kind, "gramian", clip_of)
    assert any(bool((s.pre_clip_norms > 0.5).any()) for s in stats_m)  # the clip acted
    _close(params_g, params_m, 1e-9)
    for sm, sg in zip(stats_m, stats_g):
        torch.testing.assert_close(sg.pre_clip_norms.double(), sm.pre_clip_norms.double(),
                                   rtol=1e-9, atol=0.0)
        torch.testing.assert_close(sg.weights, sm.weights, rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(sg.task_norms, sm.task_norms, rtol=1e-9, atol=0.0)


def test_norm_clipping_on_the_gramian_under_a_grad_scaler() -> None:
    scaler_m = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler_g = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    assert scaler_m.is_enabled() and scaler_g.is_enabled()
    params_m, _ = _clipped_steps("mlp", "matrix", lambda: TaskClip(0.5), scaler=scaler_m)
    params_g, stats = _clipped_steps("mlp", "gramian", lambda: TaskClip(0.5), scaler=scaler_g)
    assert not any(s.found_inf for s in stats)
    _close(params_g, params_m, 1e-5)


def test_gramian_mode_refuses_clips_that_need_the_rows() -> None:
    model, x, y = build("mlp", batch=8)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="gramian",
                         modules=model.trunk)
    for clip in (TaskValueClip(0.1), TaskClip(1.0, norm_type=1.0)):
        buf.backward(regression_losses(model(x), y))
        with pytest.raises(ValueError, match=r"needs the task-gradient rows; mode='gramian' "
                                             r"applies only 2-norm clipping"):
            buf.apply_(make_balancer("upgrad"), clip=clip)
        buf.reset()


def test_forwards_without_backward_pile_up_with_a_warning() -> None:
    model, x, _ = build("mlp", batch=4)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="gramian",
                         modules=model.trunk)
    recorder = buf._engine.recorder
    with pytest.warns(RuntimeWarning, match=r"holds 64 forwards of layer '\d'") as record:
        for _ in range(64):
            model(x)  # e.g. an evaluation loop left under grad
    assert len(record) == len(recorder.linear) == 3  # once per linear layer
    with torch.no_grad():
        model(x)  # not recorded
    assert all(len(block.calls) == 64 for block in recorder.linear)
    buf.reset()
    assert all(not block.calls for block in recorder.linear)


@pytest.mark.parametrize("mode", ["gramian", "auto"])
@pytest.mark.parametrize("force", ["activations", None])
def test_an_in_place_edit_on_a_later_micro_batch_is_refused_before_anything_moves(
        force: str | None, mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An output the activations route reads, edited in place in micro-batch 2's forward:
    ``backward`` refuses before anything moves (a check, not a failure that drops the step),
    so micro-batch 1 stays and a redone micro-batch 2 gives the full batch's update, as
    ``sum(losses).backward()`` keeps micro-batch 1's gradient when micro-batch 2's raises."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh()).double()
    model = MultiTaskModel(trunk, make_heads(6, 3)).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    trunk_ref, heads_ref, _ = _step(model, x, y, "upgrad", "matrix", (3, 5))

    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                         passes="loop", modules=model.trunk)
    engine = buf._engine
    if mode == "auto":  # its gramian route, whatever its rule picks for this model
        monkeypatch.setattr(engine, "_decide", lambda roots: "gramian")
        engine = engine._gramian  # type: ignore[attr-defined]
    engine.recorder.force = force  # type: ignore[attr-defined]
    buf.backward(regression_losses(model(x[:3]), y[:3]) * (3 / 8))
    assert buf.layer_routes["2"] == "activations"  # the last layer: by auto's rule too
    before = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    edited = trunk[:3](x[3:])
    edited.mul_(1.0)  # the last linear layer's output, kept for the activations route
    with pytest.raises(RuntimeError, match=r"modified in place.*run it again"):
        buf.backward(regression_losses([h(trunk[3](edited)) for h in model.heads], y[3:])
                     * (5 / 8))
    for p, b in zip(model.parameters(), before):
        assert (p.grad is None) == (b is None)
        if b is not None:
            assert torch.equal(p.grad, b)
    buf.backward(regression_losses(model(x[3:]), y[3:]) * (5 / 8))  # micro-batch 2, redone
    buf.apply_(make_balancer("upgrad"))
    _close(grads_of(model.shared_parameters()), trunk_ref, 1e-9)
    _close(grads_of(model.head_parameters()), heads_ref, 1e-9)
