"""Finite inputs at the edges of float32 and float16 give finite, right answers.

The references are hand-derived: a row's norm taken in float64, the clip of each row or unit
to its limit, ``wₖ Lₖ`` in float64; found where norms overflowed float32's squares (rows of
entries past 1.8e19 went unclipped, AGC wiped a gradient of 1e38) and where a float16 loss
of 0 met a weight past float16's range (``inf · 0 = NaN``).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from gradbalance import AGC, AutoClip, TaskAutoClip, TaskClip, balanced_backward
from gradbalance.balancers import Sum
from gradbalance.functional import clip_task_norms_, dwa_weights, gls_weights, row_norms
from gradbalance.weighting import DWA, GLS, STCH, ScaleInvariant


@pytest.mark.parametrize("big", [1e20, 1e30, 1e38])
def test_task_clip_clips_rows_whose_squares_overflow_float32(big: float) -> None:
    rows = torch.tensor([[big, big], [3.0, 4.0]])
    expected_norm = big * math.sqrt(2.0)
    got = row_norms(rows)
    assert torch.isfinite(got[0]) or expected_norm > torch.finfo(torch.float32).max
    if expected_norm < torch.finfo(torch.float32).max:
        assert got[0].item() == pytest.approx(expected_norm, rel=1e-6)
        clipped = rows.clone()
        TaskClip(max_norm=1.0)(clipped)
        assert float(torch.linalg.vector_norm(clipped[0].double())) == pytest.approx(1.0, rel=1e-5)
        assert torch.equal(clipped[1], rows[1] * (1.0 / (5.0 + 1e-6)))


def test_the_step_clips_such_a_row_in_matrix_mode() -> None:
    w = nn.Parameter(torch.zeros(2))
    stats = balanced_backward([w @ torch.tensor([1e20, 1e20]), w @ torch.tensor([3.0, 4.0])],
                              Sum(), shared_params=[w], clip=TaskClip(max_norm=1.0))
    assert not stats.found_inf
    expected = torch.tensor([1.0, 1.0], dtype=torch.float64) / math.sqrt(2.0) + torch.tensor(
        [3.0, 4.0], dtype=torch.float64) / (5.0 + 1e-6)
    assert w.grad is not None and torch.allclose(w.grad.double(), expected, rtol=1e-6)


def test_task_auto_clip_and_auto_clip_record_and_clip_such_norms() -> None:
    rows = torch.tensor([[1e20, 1e20], [3.0, 4.0]])
    clip = TaskAutoClip(percentile=0)
    norms = clip(rows.clone())
    assert bool(torch.isfinite(norms).all())
    p = nn.Parameter(torch.ones(3))
    auto = AutoClip(percentile=0)
    p.grad = torch.ones(3)
    auto([p])  # history: sqrt(3)
    p.grad = torch.full((3,), 1e20)
    total = auto([p])
    assert total.item() == pytest.approx(math.sqrt(3.0) * 1e20, rel=1e-6)
    assert float(torch.linalg.vector_norm(p.grad.double())) == pytest.approx(math.sqrt(3.0),
                                                                              rel=1e-5)


def test_agc_clips_a_gradient_of_1e38_to_its_limit() -> None:
    p = nn.Parameter(torch.ones(2, 2))
    p.grad = torch.full((2, 2), 1e38)
    total = AGC(0.1)([p])
    assert math.isfinite(total.item())
    limit = 0.1 * math.sqrt(2.0)  # λ · ‖Wᵢ‖ per row
    row = torch.linalg.vector_norm(p.grad.double(), dim=1)
    assert torch.allclose(row, torch.full((2,), limit, dtype=torch.float64), rtol=1e-5)


@pytest.mark.parametrize("make", [lambda: GLS(2), lambda: ScaleInvariant(2),
                                  lambda: STCH(2, warmup_steps=2)], ids=["gls", "si", "stch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_zero_loss_in_half_precision_gives_a_finite_weighted_loss(make: Any,
                                                                  dtype: torch.dtype) -> None:
    losses = torch.tensor([0.0, 1.0], dtype=dtype)
    weighting = make()
    out = weighting(losses)
    expected = (weighting.weights * losses.double()).to(dtype)  # wₖ Lₖ in float64
    assert out.dtype == dtype and bool(torch.isfinite(out).all())
    assert torch.equal(out, expected)


def test_dwa_at_a_tiny_temperature_gives_the_task_with_the_largest_rate_every_weight() -> None:
    got = dwa_weights(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]), temperature=1e-9)
    assert torch.equal(got, torch.tensor([0.0, 2.0], dtype=torch.float64))
    dwa = DWA(2, temperature=1e-9, period=1)
    for losses in ([0.0, 0.0], [0.0, 0.0], [1.0, 1.0]):
        dwa(torch.tensor(losses))
        dwa.update()
    assert bool(torch.isfinite(dwa.weights).all())


@pytest.mark.parametrize(("call", "text"), [
    (lambda: gls_weights(torch.tensor([0.0, 1.0]), eps=0.0), "Invalid eps: 0.0"),
    (lambda: gls_weights(torch.tensor([-1.0, 1.0])), "Invalid losses"),
    (lambda: dwa_weights(torch.ones(2), torch.tensor([-1.0, 1.0])), "Invalid before_previous"),
    (lambda: clip_task_norms_(torch.ones(2, 2), torch.tensor([-1.0, -1.0])), "Invalid max_norm"),
    (lambda: clip_task_norms_(torch.ones(2, 2), torch.tensor([math.nan, 1.0])),
     "Invalid max_norm"),
    (lambda: clip_task_norms_(torch.ones(2, 2), torch.tensor(0.0)), "Invalid max_norm"),
    (lambda: clip_task_norms_(torch.ones(2, 2), torch.ones(3)), "Invalid max_norm: shape"),
])
def test_what_gave_nan_or_a_torch_error_is_refused_by_name(call: Any, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        call()


@pytest.mark.parametrize("shift", [0.0, 1e16, 1e300, -1e300])
def test_the_simplex_projection_of_huge_entries_is_that_of_the_shifted_vector(
        shift: float) -> None:
    # Σw = 1 makes the projection shift-invariant: (0.9, 0.3, −2) + s projects to
    # (0.8, 0.2, 0) for every s (hand-derived: θ = 0.1 + s); at s = 1e300 the largest
    # entry less 1 rounded to itself and the count of the active prefix was 0 (index −1)
    from gradbalance.balancers._solvers import project_simplex
    v = torch.tensor([0.9, 0.3, -2.0], dtype=torch.float64) + shift
    got = project_simplex(v)
    if abs(shift) < 1e15:
        torch.testing.assert_close(got, torch.tensor([0.8, 0.2, 0.0], dtype=torch.float64))
    else:  # the differences themselves round away: the largest entry takes it all
        assert float(got.sum()) == pytest.approx(1.0) and bool((got >= 0).all())
    assert bool(torch.isnan(project_simplex(torch.tensor([float("nan"), 1.0]))).all())


def test_moco_names_losses_whose_scaled_units_overflow_the_rows_dtype() -> None:
    from gradbalance.balancers import MoCo
    g = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    moco = MoCo(normalize_grads=True)
    for big in (1e39, 1e300):
        with pytest.raises(ValueError, match=r"Invalid losses.*overflows torch\.float32"):
            moco.combine(g, torch.full((3,), big, dtype=torch.float64))
    assert int(moco.state_dict()["_step"]) == 0  # refused before anything moved
    out = moco.combine(g, torch.full((3,), 1e30, dtype=torch.float64))
    assert bool(torch.isfinite(out.vector).all())
