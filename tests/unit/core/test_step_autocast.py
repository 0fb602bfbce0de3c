"""The step called inside ``torch.autocast`` (as Lightning's training_step does).

The gradient arithmetic (Gramian, combine, write-back) must run in the gradients' dtype, so
the result equals the same step outside autocast; under a 16-bit autocast a GEMM on the
float32 gradients would lose about 3 significant digits, or fail to write a bf16 result into
a float32 ``.grad``.
"""

from __future__ import annotations

import pytest
import torch

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Mean
from support.helpers import assert_rel_close_lists, build, grads_of
from support.perf import losses_of_features

MODES = ("matrix", "features", "gramian", "auto")


def _step(mode: str, autocast: torch.dtype | None, existing_grad: bool,
          scaler: torch.amp.GradScaler | None = None):
    """Forward outside autocast (identical losses), then backward + apply_ inside it."""
    model, x, y = build("mlp", num_tasks=3)
    if existing_grad:
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.25)
    kwargs = {"modules": model.trunk} if mode in ("gramian", "auto") else {}
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                         **kwargs)
    feats = model.trunk(x)
    losses = losses_of_features(model, feats, y)
    context = (torch.autocast("cpu", dtype=autocast) if autocast is not None
               else torch.autocast("cpu", enabled=False))
    with context:
        buf.backward(losses, scaler=scaler, features=feats if mode == "features" else None)
        stats = buf.apply_(Mean(), scaler=scaler)
    return grads_of(model.shared_parameters()), grads_of(model.head_parameters()), stats


@pytest.mark.parametrize("existing_grad", [False, True], ids=["fresh", "accumulate"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("mode", MODES)
def test_step_under_autocast_equals_step_outside(mode: str, dtype: torch.dtype,
                                                 existing_grad: bool) -> None:
    trunk_ref, heads_ref, stats_ref = _step(mode, None, existing_grad)
    trunk, heads, stats = _step(mode, dtype, existing_grad)
    assert all(g.dtype == torch.float32 for g in trunk + heads)
    # 16-bit arithmetic would be off by ~1e-3 relative; float32 reordering stays far below.
    assert_rel_close_lists(trunk, trunk_ref, rtol=1e-6)
    assert_rel_close_lists(heads, heads_ref, rtol=1e-6)
    torch.testing.assert_close(stats.task_norms, stats_ref.task_norms, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(stats.cosine, stats_ref.cosine, rtol=1e-6, atol=1e-9)


def test_step_under_autocast_with_grad_scaler() -> None:
    scale = 2.0**10
    trunk_ref, _, _ = _step("matrix", None, False)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    assert scaler.is_enabled()
    trunk, _, stats = _step("matrix", torch.bfloat16, False, scaler=scaler)
    assert stats.loss_scale == scale and not stats.found_inf
    assert_rel_close_lists([g / scale for g in trunk], trunk_ref, rtol=1e-6)
