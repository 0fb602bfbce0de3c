"""The clip tutorial's figures at --quick size: every claim met, and one check per figure
recomputed here, outside the figure (closed forms, a per-sample loop, numpy percentiles, one
process on the whole batch).
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch

from gradbalance_lab.figures import FIGURES, load

CLIP_FIGURES = [name for name in FIGURES if name.startswith("clip_")]


@cache
def quick(name: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    result: dict[str, Any] = load(name).compute(quick=True)
    return result


def test_the_clip_figures_are_registered() -> None:
    assert CLIP_FIGURES == ["clip_basics", "clip_explode", "clip_accumulation",
                            "clip_threshold", "clip_nonfinite", "clip_api", "clip_amp",
                            "clip_depth", "clip_autoclip", "clip_agc", "clip_per_sample",
                            "clip_small_tau", "clip_ddp"]


@pytest.mark.parametrize("name", [*CLIP_FIGURES, "clipping"])
def test_every_claim_is_met_and_names_its_section(name: str) -> None:
    module = load(name)
    claims = module.claims(quick(name))
    assert claims
    for claim in claims:
        assert claim.met is True, f"{claim.text}: {claim.measured}"
        assert claim.text.startswith(("§", "clip tutorial §")), claim.text


def test_basics_factor_25_by_hand() -> None:
    r = quick("clip_basics")
    # by hand: 10 / (250 + 1e-6) is the factor; float32 rounds it and each product
    factor = np.float32(10.0) / (np.float32(250.0) + np.float32(1e-6))
    by_hand = (np.array([150.0, 200.0], dtype=np.float32) * factor).tolist()
    assert r["large"]["after"] == pytest.approx(by_hand, rel=2**-23)
    ratios = [b / a for a, b in zip(r["large"]["after"], (150.0, 200.0))]
    assert ratios == pytest.approx([25.0, 25.0], rel=1e-6)  # divided by 25
    assert r["small"]["after"] == r["small"]["before"]  # size 3 < 10: untouched
    assert r["large"]["size_after"] == pytest.approx(10.0, abs=2 * 2**-20)  # 2 float32 steps
    assert r["eps"]["torch"] == pytest.approx(1e-6, rel=1e-8)


def test_accumulation_per_micro_batch_closed_form() -> None:
    from gradbalance_lab.figures.clip_accumulation import BATCH, MICRO, TAU, setup

    r = quick("clip_accumulation")
    model, x, y = setup(5)  # the --quick batches

    def plain_grad(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        out = model(xb)
        torch.stack([torch.nn.functional.mse_loss(o.squeeze(-1), yb[:, k])
                     for k, o in enumerate(out)]).sum().backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    full = plain_grad(x[0], y[0])
    once = full * min(1.0, TAU / (float(full.norm()) + 1e-6))
    parts = [plain_grad(xb, yb) for xb, yb in zip(x[0].split(BATCH // MICRO),
                                                  y[0].split(BATCH // MICRO))]
    each = sum(g * min(1.0, TAU / (float(g.norm()) + 1e-6)) for g in parts) / MICRO
    row = r["rows"][0]
    assert row["once_len"] == pytest.approx(float(once.norm()), rel=1e-12)
    assert row["each_len"] == pytest.approx(float(each.norm()), rel=1e-12)
    cos = float(once @ each / (once.norm() * each.norm()))
    assert row["angle"] == pytest.approx(math.degrees(math.acos(min(1.0, cos))), abs=1e-6)


def test_threshold_limits_are_numpy_percentiles() -> None:
    r = quick("clip_threshold")
    norms = r["logged"]["norms"]
    for q, run in r["runs"].items():
        assert run["tau"] == pytest.approx(float(np.percentile(norms, q)), rel=1e-12)
        share = sum(n > run["tau"] for n in run["norms"]) / len(run["norms"])
        assert run["share"] == share


def test_nonfinite_torch_and_library_by_hand() -> None:
    r = quick("clip_nonfinite")
    assert all(math.isnan(v) for v in r["nan"]["after"])  # one NaN spreads to every entry
    inf_after = r["inf"]["after"]
    assert math.isnan(inf_after[1]) and inf_after[:1] + inf_after[2:] == [0.0] * 4  # c/inf = 0
    assert r["step_amp"]["scale"] == 2.0**15  # the scaler halved its scale: step skipped
    assert r["lib_nan"]["task_rows"][0] == pytest.approx([0.6, 0.8], rel=1e-6)


def test_api_inf_norm_is_the_largest_entry() -> None:
    from gradbalance_lab.figures.clip_api import _model

    r = quick("clip_api")
    model, matrix = _model()
    largest = max(float(p.grad.abs().max()) for p in model.parameters())
    assert r["inf"]["returned"] == largest
    assert r["inf"]["rows_pre"] == matrix.abs().amax(dim=1).tolist()
    assert r["foreach"]["same_grads"]


def test_amp_off_by_the_scale() -> None:
    assert torch.amp.GradScaler("cpu").is_enabled()
    r = quick("clip_amp")
    s, n = r["scale"], r["true_norm"]
    assert r["pre_wrong"] == pytest.approx(s * n, rel=1e-6)
    assert r["right_len"] / r["wrong_len"] == pytest.approx((s * n + 1e-6) / (n + 1e-6),
                                                            rel=1e-6)
    sweep = r["sweep"]
    for true, right, wrong in zip(sweep["true"], sweep["right"], sweep["wrong"]):
        # the right order caps at τ, the wrong one at τ/s (plus ε, float32 rounding)
        assert right == pytest.approx(min(true, 1.0), rel=1e-5)
        assert wrong == pytest.approx(min(true, 1.0 / s), rel=1e-5)


def test_autoclip_threshold_is_the_numpy_percentile() -> None:
    r = quick("clip_autoclip")
    for t, threshold in enumerate(r["threshold"]):
        want = float(np.percentile(r["norm"][: t + 1], r["percentile"]))
        assert threshold == pytest.approx(want, rel=1e-12)


def test_agc_ratio_by_hand() -> None:
    from gradbalance.clip import AGC
    from gradbalance_lab.figures.clip_agc import EPS, LAMBDA, model_with_grads

    model = model_with_grads()
    weight = model.trunk[0].weight
    g = weight.grad.detach().double().clone()
    w = weight.detach().double()
    AGC(LAMBDA, eps=EPS, exclude=model.head_parameters())(model.parameters())
    for i in range(w.shape[0]):  # unit i: row i of the weight
        wn = max(float(w[i].norm()), EPS)
        gn = float(g[i].norm())
        want = g[i] * (LAMBDA * wn / gn if gn / wn > LAMBDA else 1.0)
        assert weight.grad[i].double().tolist() == pytest.approx(want.tolist(), rel=1e-6,
                                                                 abs=1e-12)
    assert quick("clip_agc")["agc_first"]


def test_per_sample_equals_a_loop_written_here() -> None:
    from gradbalance.clip import PerSampleClip
    from gradbalance_lab.figures.clip_per_sample import (
        C,
        library_step,
        per_sample_losses,
        setup,
    )

    model, x, y = setup()
    params = list(model.parameters())
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for i in range(x.shape[0]):
        model.zero_grad(set_to_none=True)
        per_sample_losses(model, x[i:i + 1], y[i:i + 1]).sum().backward()
        g = torch.cat([p.grad.reshape(-1) for p in params])
        total += g * min(1.0, C / (float(g.norm()) + 1e-6))
    reference = total / x.shape[0]
    clipped = library_step(model, x, y, PerSampleClip(C, per_task=False))
    # library_step flattens trunk then heads, the model's own parameter order
    assert torch.allclose(clipped, reference, rtol=1e-12, atol=1e-14)
    r = quick("clip_per_sample")
    assert r["expected_std"] == 1.0 * C / x.shape[0]


def test_small_tau_limits_by_hand() -> None:
    from gradbalance_lab.figures.clip_small_tau import gradients

    g = gradients(1)[0]
    c = 1e-3
    w = torch.nn.Parameter(torch.zeros_like(g))
    w.grad = g.clone()
    torch.nn.utils.clip_grad_norm_([w], c)
    assert torch.allclose(w.grad / c, g / (g.norm() + 1e-6), rtol=1e-12, atol=0)
    r = quick("clip_small_tau")
    assert r["sign_exact"] and r["lengths"] == pytest.approx([r["small_c"]] * len(r["lengths"]),
                                                             rel=1e-5)


def test_ddp_after_sync_equals_one_process_here() -> None:
    from gradbalance.balancers import get_balancer
    from gradbalance.step import TaskGradBuffer
    from gradbalance_lab.figures.clip_ddp import TAU, setup
    from gradbalance_lab.models import regression_losses

    r = quick("clip_ddp")
    model, x, y = setup()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    buf.backward(regression_losses(model(x), y))
    buf.apply_(get_balancer("sum"))
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), TAU))
    assert r["after_norms"] == pytest.approx([norm, norm], rel=1e-12)
    assert r["before_norms"][0] != pytest.approx(r["before_norms"][1], rel=1e-3)
    assert r["before_angle"] > 1.0


def test_clipping_turn_closed_form() -> None:
    r = quick("clipping")
    turn = r["turn"]
    # rows (30, 40) → (0.6, 0.8)·50/(50 + 1e-6), (−0.4, 0.3) kept: the sum (0.2, 1.1)
    combined = np.array([0.6, 0.8]) * 50 / (50 + 1e-6) + np.array([-0.4, 0.3])
    assert turn["combined"] == pytest.approx(combined.tolist(), rel=1e-12)
    unclipped = np.array([29.6, 40.3])
    cos = combined @ unclipped / (np.linalg.norm(combined) * np.linalg.norm(unclipped))
    assert turn["turn"] == pytest.approx(math.degrees(math.acos(cos)), abs=1e-9)
    assert r["sweep_turn"][0] < 1e-6 and r["sweep_turn"][-1] < 1e-6  # parallel rows: no turn


def test_clip_explode_runs() -> None:
    r = quick("clip_explode")
    for lr in (0.01, 0.03):
        runs = r[lr]["runs"]
        # τ is the healthy run's 95th percentile (numpy as the second implementation)
        assert r[lr]["tau"] == pytest.approx(float(np.percentile(runs["healthy"]["norm"], 95)),
                                             rel=1e-9)
        assert all(np.isfinite(runs["clipped"]["loss"])) and len(runs["clipped"]["loss"]) == 200
    hot = r[0.03]["runs"]["unclipped"]["loss"]
    assert not np.isfinite(hot[-1])  # lr 0.3 unclipped: the loss turns inf or NaN
    before = r[0.03]["runs"]["before backward"]
    assert set(before["norm"]) == {0.0}  # before backward there is no gradient to measure
    assert before["loss"] == hot and r[0.03]["runs"]["after step"]["loss"] == hot
