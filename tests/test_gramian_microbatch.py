"""``gramian`` mode over several micro-batches: the full batch's Gramian and update.

The reference is ``matrix`` mode on the whole batch: it sums the ``[K, P]`` rows and never
settles anything, so it is an independent computation of the same update.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.models import MultiTaskModel, make_heads, regression_losses
from helpers import TRUNKS, build, grads_of
from perf_util import make_balancer

SPLITS = [(8,), (3, 5), (2, 1, 5)]


def _step(model: MultiTaskModel, x: Tensor, y: Tensor, name: str, mode: str,
          split: tuple[int, ...], scaler: torch.amp.GradScaler | None = None,
          strategy: str = "auto") -> tuple[list[Tensor], list[Tensor], Tensor]:
    """One step over the micro-batches of ``split``, each loss weighted by its share."""
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                         strategy=strategy,  # type: ignore[arg-type]
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
    trunk_ref, heads_ref, _ = _step(model, x, y, "upgrad", "matrix", SPLITS[0], strategy="loop")
    trunk, heads, _ = _step(model, x, y, "upgrad", "gramian", (3, 5), strategy="batched")
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
    for _ in range(3):
        for part in (slice(0, 4), slice(4, 8)):
            buf.backward(regression_losses(model(x[part]), y[part]) / 2)
        buf.apply_(make_balancer("mgda"))
        assert all(not block.calls and block.rows is None for block in recorder.blocks)
