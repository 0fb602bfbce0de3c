"""The loop tutorial's figures added for its uncovered claims, at --quick size: each runs, its
claims are met, and one number per figure is recomputed here independently (numpy, a closed
form, or torch's own objects)."""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch

from gradbalance_lab.figures import load

LOOP = ["task_grads", "loss_scale", "momentum", "adam_turn", "adam_tilt", "pcgrad_momentum",
        "mgda_noise", "gradnorm", "weight_decay", "adam_absorb", "mixed_precision", "amp_cpu",
        "microbatch", "logging", "fp16_underflow", "optim_rules"]
NEW = ["task_grads", "adam_absorb", "amp_cpu"]


@cache
def quick(name: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    return load(name).compute(quick=True)


@pytest.mark.parametrize("name", NEW)
def test_new_figure_claims_met(name: str) -> None:
    claims = load(name).claims(quick(name))
    assert claims
    assert not [c for c in claims if c.met is False], [c.measured for c in claims]


@pytest.mark.parametrize("name", LOOP)
def test_every_claim_names_its_section(name: str) -> None:
    for claim in load(name).claims(quick(name)):
        assert claim.text.startswith("§"), claim.text


def test_task_grads_sum_is_n_times_mean_and_heads_scale() -> None:
    r = quick("task_grads")
    b = r["batch"]
    for n, mean, total in zip(b["n"], b["norms"]["mean"], b["norms"]["sum"]):
        # MSELoss(sum) = n · MSELoss(mean) on the same batch: exactly n times the gradient
        np.testing.assert_allclose(np.array(total) / np.array(mean), n, rtol=1e-10)
    assert abs(b["slope_sum"] - b["slope_mean"] - 1) < 1e-9  # log-log: the same offset log n
    np.testing.assert_allclose(r["head_ratio"], [0.5, 2.0, 3.0], rtol=1e-12)  # the weights
    assert r["passes"] == 3 and r["matrix_shape"][0] == 3


def test_amp_cpu_against_torch_scalers() -> None:
    r = quick("amp_cpu")
    assert r["cuda"] == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.warns(UserWarning, match="CUDA is not available"):  # it says so
            assert torch.amp.GradScaler().is_enabled() is False  # the text's default scaler
    cpu = torch.amp.GradScaler("cpu")
    steps = r["cpu"]["steps"]
    assert steps[0]["s"] == cpu.get_scale() == 2.0**16
    bad = steps[2]  # the overflow step
    assert bad["skipped"] and bad["scale_after"] == bad["s"] * cpu.get_backoff_factor()
    for step in steps[:2]:  # good steps: ‖G_k‖/s is the true size
        np.testing.assert_allclose(step["sizes"], step["true_sizes"], rtol=1e-5)


def test_adam_absorb_against_a_numpy_adam() -> None:
    """Adam (numpy, PyTorch's update rule) on white-noise gradients w_t·ξ_t with the figure's
    schedule: the step ratios land where the figure measured them."""
    r = quick("adam_absorb")
    module = load("adam_absorb")
    schedule = module._schedule(r["warm"], r["change"], r["after"]).numpy()
    weights = 0.5 * np.exp(-schedule)  # Uncertainty Weighting, regression: ½·e^{−s}
    rng = np.random.default_rng(0)
    noise = rng.standard_normal((schedule.shape[0], 4000))
    b1, b2, eps, lr = 0.9, 0.999, 1e-8, 1e-3
    m = np.zeros((3, noise.shape[1]))
    v = np.zeros_like(m)
    sizes = np.zeros((schedule.shape[0], 3))
    for t in range(schedule.shape[0]):
        g = weights[t][:, None] * noise[t][None, :]
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        step = lr * (m / (1 - b1 ** (t + 1))) / (np.sqrt(v / (1 - b2 ** (t + 1))) + eps)
        sizes[t] = np.linalg.norm(step, axis=1)
    end = slice(r["warm"] + r["change"] - 300, r["warm"] + r["change"])
    jump = slice(r["warm"] + 10, r["warm"] + 60)
    slow = sizes[end, 1].mean() / sizes[end, 0].mean()
    early = sizes[jump, 2].mean() / sizes[jump, 0].mean()
    assert r["adam"]["slow_end"] == pytest.approx(slow, rel=0.15)  # noise of a 16-weight head
    assert r["adam"]["sudden_early"] == pytest.approx(early, rel=0.15)
    assert r["sgd"]["slow_end"] == pytest.approx(r["sgd"]["slow_weight"], rel=0.15)  # lr·w·g


def test_microbatch_medians_with_numpy_kernels() -> None:
    """PCGrad and MGDA for two tasks written in numpy, on the figure's first reading."""
    r = quick("microbatch")
    module = load("microbatch")
    points, unit = module._draw(0, r["points"])
    exact = (points.numpy()[:, None, :] - np.array([[3.0, 0.0], [0.0, 3.0]])) * [10.0, 1.0]
    sigma = np.linalg.norm(exact, axis=(1, 2)) / 2
    parts = exact[:, None] + unit.numpy() * sigma[:, None, None, None]

    def pcgrad(g: np.ndarray) -> np.ndarray:
        g1, g2 = g[..., 0, :], g[..., 1, :]
        d = (g1 * g2).sum(-1, keepdims=True)
        c = np.minimum(d, 0.0)
        return g1 + g2 - c / (g2 * g2).sum(-1, keepdims=True) * g2 \
            - c / (g1 * g1).sum(-1, keepdims=True) * g1

    def mgda(g: np.ndarray) -> np.ndarray:
        g1, g2 = g[..., 0, :], g[..., 1, :]
        gam = np.clip(((g2 - g1) * g2).sum(-1, keepdims=True)
                      / ((g1 - g2) ** 2).sum(-1, keepdims=True), 0, 1)
        return gam * g1 + (1 - gam) * g2

    for name, bal in (("pcgrad", pcgrad), ("mgda", mgda)):
        once, each = bal(parts.mean(1)), bal(parts).mean(1)
        cos = (once * each).sum(-1) / np.linalg.norm(once, axis=-1) / np.linalg.norm(each, axis=-1)
        angles = np.sort(np.degrees(np.arccos(np.clip(cos, -1, 1))))
        median = float(angles[(len(angles) - 1) // 2])  # torch's median: the lower middle
        assert r["medians"]["micro-batch/same"][name][0] == pytest.approx(median, abs=1e-6)
    fb = r["full_batch"]
    assert fb["matrix_gap"] < 1e-12 and fb["pcgrad"]["once_gap"] < 1e-12


def test_mgda_share_readings() -> None:
    r = quick("mgda_noise")
    # the two readings differ exactly by the ratio of the first step to the first window
    for share, share_w in zip(r["share"], r["share_window"]):
        assert share < share_w  # the first step is the largest of the first window
    assert r["library_gap"] < 1e-10 and r["kernel_gap"] < 1e-12


def test_gradnorm_drift_under_sgd_and_adam() -> None:
    r = quick("gradnorm")
    assert r["lr_ratio"]["ratio_lr"] == pytest.approx(0.025 / 2e-5)  # the text's ≈1250
    assert r["lr_ratio"]["first"] == pytest.approx(1250, rel=0.01)  # Adam's first step is lr
    assert r["sgd"]["gap"]["scheduled"] < 1e-4  # SGD: the drift is the schedule lr·Σw/K


def test_pcgrad_momentum_uphill_steps() -> None:
    r = quick("pcgrad_momentum")
    assert r["heavy"]["handed_uphill"] == 0 and r["plain"]["step_uphill"] == 0
    assert r["heavy"]["step_uphill"] > 0


def test_weight_decay_adam_vs_adamw_per_wd() -> None:
    r = quick("weight_decay")
    adamw = [r["adamw"][wd]["per_step"] for wd in (0.01, 0.1, 1.0)]
    adam = [r["adam"][wd]["per_step"] for wd in (0.01, 0.1, 1.0)]
    # AdamW on a weight no task pushes: w·(1 − lr·wd)^t, so the mean shrink per step is
    # (1 − (1 − lr·wd)^200)/200
    for wd, shrink in zip((0.01, 0.1, 1.0), adamw):
        assert shrink == pytest.approx((1 - (1 - 1e-3 * wd) ** 200) / 200, rel=1e-9)
    assert max(adam) - min(adam) < 1e-3 * 1e-3  # Adam: the same whatever wd


def _noisy_adam(wd: float, n: int = 256, steps: int = 200, lr: float = 1e-3) -> float:
    """Adam written out here (Kingma & Ba 2015, PyTorch's defaults, L2 decay added to the
    gradient) on n weights from 1 whose gradient is ξ (same draws as the figure)."""
    gen = torch.Generator().manual_seed(0)
    w = np.ones(n)
    m, v = np.zeros(n), np.zeros(n)
    for t in range(1, steps + 1):
        g = torch.randn(n, generator=gen, dtype=torch.float64).numpy() + wd * w
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        w = w - lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
    return float(1 - w.mean()) / steps


def test_weight_decay_adam_with_noisy_task_gradient() -> None:
    r = quick("weight_decay")
    control = _noisy_adam(0.0)
    for wd in (0.01, 0.1, 1.0):
        assert r["noisy_adam"][wd] == pytest.approx(_noisy_adam(wd) - control, rel=1e-6)


def test_adam_tilt_sgd_path_starts_at_the_start() -> None:
    r = quick("adam_tilt")
    assert (r["sgd"]["x"][0], r["sgd"]["y"][0]) == (5.0, 5.0)
    assert (r["adam"]["x"][0], r["adam"]["y"][0]) == (5.0, 5.0)
    assert math.isclose(r["sgd"]["tilt"], 0.0, abs_tol=1e-3)


def test_fp16_underflow_against_float64() -> None:
    r = quick("fp16_underflow")
    assert r["scale"] == 2.0**16  # GradScaler's default initial scale
    entries = np.array(r["entries"])
    # round to nearest: entries below half of float16's smallest subnormal 2⁻²⁴ become 0
    below = float(np.mean(entries < 2.0**-25))
    assert r["unscaled"]["zero_share"][1] >= below - 0.1
    assert r["scaled"]["zero_share"][1] == 0.0 and r["scaled"]["error"][1] < 1e-2


def test_momentum_beta_zero_keeps_only_this_step() -> None:
    r = quick("momentum")
    assert r["memory_0"] == 1.0  # Σ βⁿ at β = 0
    assert r["angles_0"][0] == pytest.approx(90.0, abs=1e-9)  # the new gradient at once


def test_l2_in_the_loss_reaches_pcgrad() -> None:
    l2 = quick("weight_decay")["l2"]
    # task 1: ∇(w₁ + ¼‖w‖²) at (1, 1) = (1.5, 0.5); task 2: (−1, 1); g₁·g₂ = −1, so by hand
    # g₁' = g₁ + ½g₂ = (1, 1), g₂' = g₂ + 0.4g₁ = (−0.4, 1.2), sum (0.6, 2.2)
    assert l2["penalty"]["matrix"].tolist() == [[1.5, 0.5], [-1.0, 1.0]]
    assert l2["penalty"]["grad"].tolist() == pytest.approx([0.6, 2.2], abs=1e-12)
