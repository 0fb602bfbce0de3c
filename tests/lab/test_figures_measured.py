"""The register rows measured last (optimizer rules, the ten-step average, a common factor
under Adam, GradNorm's fragment, balancing not linear, clipping's signature and global norm,
the seismograph at lr × 10, depth-T Jacobian products), at --quick size: one number per row
recomputed here from a closed form, a case worked by hand or numpy."""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch

from gradbalance.balancers import get_balancer
from gradbalance_lab.figures import clip_api, load
from gradbalance_lab.figures.clip_depth import lyapunov


@cache
def quick(name: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    result: dict[str, Any] = load(name).compute(quick=True)
    return result


def test_adam_couples_the_decay_into_m() -> None:
    # step 1: g = c₁ + c₂ = (0.75, 2, 1), θ₀ = (1, −2, 0.5), wd 0.5: g + wd·θ₀ = (1.25, 1, 1.25);
    # m₁ = (1 − β₁)(g + wd·θ₀) = (0.125, 0.1, 0.125); AdamW's m₁ would be (0.075, 0.2, 0.1)
    m1 = quick("optim_rules")["rules"]["adam_wd_m1"]
    assert m1 == pytest.approx([0.125, 0.1, 0.125], abs=1e-15)


def test_ten_step_average_lag_and_smoothing() -> None:
    avg = quick("optim_rules")["average"]
    # exp_avg after n + 1 steps of the new gradient 1 (from 0): 1 − 0.9ⁿ⁺¹
    response = np.array(avg["response"][10:])
    assert response == pytest.approx(1 - 0.9 ** np.arange(1, len(response) + 1), abs=1e-12)
    assert avg["lag"] == pytest.approx(0.9 / 0.1, abs=1e-9)  # Σₙ 0.9ⁿ, n ≥ 1
    # AR(1) with coefficient 0.9 fed (1 − 0.9)·ξ: variance 0.01/(1 − 0.81) of ξ's
    for ratio in avg["ratios"]:
        assert ratio == pytest.approx(math.sqrt(0.01 / 0.19), rel=0.06)  # 4,000 steps


def test_adam_cancels_a_common_factor_sgd_does_not() -> None:
    common = quick("optim_rules")["common"]
    assert common["adam"]["ratio_lo"] == pytest.approx(1.0, abs=1e-6)
    assert common["adam"]["ratio_hi"] == pytest.approx(1.0, abs=1e-6)
    assert common["sgd"]["first"] == pytest.approx(0.5, abs=1e-12)  # Mean = Sum / 2
    assert common["sgd"]["end_gap"] > 1e-3


def test_gradnorm_fragment_against_its_closed_forms() -> None:
    frag = quick("gradnorm")["fragment"]
    assert frag["only_w"] and frag["leaf"]
    assert frag["closed_gap"] < 1e-12 and frag["in_graph_gap"] > 1e-3
    assert abs(frag["in_graph_dot"]) < 1e-12  # the differentiated rescale is scale-free


def test_balancing_is_not_linear_by_hand() -> None:
    # A = [(1, 0), (0, 1)], C = [(1, 0), (−1, 0)], A + C = [(2, 0), (−1, 1)]
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    c = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=torch.float64)
    # PCGrad on A + C: dot −2; (2, 0) − (−2/2)(−1, 1) = (1, 1), (−1, 1) − (−2/4)(2, 0) = (0, 1)
    assert get_balancer("pcgrad")(a + c).tolist() == pytest.approx([1.0, 2.0], abs=1e-15)
    # MGDA on A + C: γ = (‖g₂‖² − g₁·g₂)/‖g₁ − g₂‖² = 4/10
    assert get_balancer("mgda")(a + c).tolist() == pytest.approx([0.2, 0.6], abs=1e-12)
    lin = quick("microbatch")["not_linear"]
    assert lin["pcgrad"]["right"] == pytest.approx([1.0, 1.0], abs=1e-15)  # (1, 1) + 0
    assert lin["mgda"]["right"] == pytest.approx([0.5, 0.5], abs=1e-15)
    assert lin["mean"]["left"] == pytest.approx(lin["mean"]["right"], abs=1e-15)


def test_global_norm_is_over_all_entries() -> None:
    model, _ = clip_api._model()
    entries = np.concatenate([p.grad.detach().double().numpy().ravel()
                              for p in model.parameters() if p.grad is not None])
    glob = quick("clip_api")["global"]
    assert glob["returned"] == pytest.approx(float(np.linalg.norm(entries)), rel=1e-6)
    assert glob["largest"] < 0.99 * glob["returned"]  # not a per-tensor norm


def test_no_default_limit() -> None:
    no_default = quick("clipping")["no_default"]
    assert set(no_default) == {"clip_grad_norm_", "clip_grad_value_", "TaskClip"}
    assert all(v["required"] and v["arg"] in v["error"] for v in no_default.values())


def test_seismograph_spikes_in_the_clipped_run() -> None:
    r = quick("clip_explode")
    for lr in (0.01, 0.03):
        runs = r[lr]["runs"]
        tau = float(np.percentile(runs["healthy"]["norm"], 95))
        assert max(runs["clipped"]["norm"]) > 10 * tau
        assert np.isfinite(runs["clipped"]["loss"]).all()


def test_depth_products_against_log_rho_and_lyapunov() -> None:
    r = quick("clip_depth")
    for rho in (1.1, 0.9):
        for slope in r["rnn_slopes"][rho]:
            assert slope == pytest.approx(math.log(rho), rel=0.1)
    # ψ(32) = H₃₁ − γ (the digamma function at an integer)
    psi = sum(1 / k for k in range(1, 32)) - 0.5772156649015329
    assert lyapunov(1.5, 64) == pytest.approx(math.log(1.5) + 0.5 * (psi + math.log(2 / 64)),
                                              abs=1e-12)
    slopes = r["net_slopes"][1.5]
    assert all(s > 0.3 for s in slopes)  # about 0.40 per layer: the blame snowballs
