"""§9.2 Weight decay: Adam (coupled L2) against AdamW (decoupled), and Uncertainty Weighting.

Setting (optimizers): weights ``w ∈ R²`` start at (1, 1); one task with the loss ``w₁``, so
the first weight has gradient 1 and the second has none. The step runs through
:class:`~gradbalance.TaskGradBuffer` (``PCGrad`` when present, else ``Sum``: with one task
both are the identity), then ``torch.optim.Adam`` or ``AdamW`` at lr 1e-3 with
``weight_decay`` 0.01, 0.1 and 1, for 200 steps. On the second weight, AdamW shrinks by the
factor ``1 − lr·wd`` per step (closed form); Adam adds ``wd·w`` to the gradient before ``m``
and ``v``, so its normalised step is about ``lr`` whatever ``wd``. The ``.grad`` the balancer
writes is compared across ``wd``: decay happens inside ``opt.step()``, after it.

The text's "a larger wd shrinks them faster" is measured for Adam on weights that do get a
task gradient: 256 weights start at 1, each with a task gradient that is pure batch noise
(``ξ·w``, ξ standard Gaussian, drawn fresh every step from a seeded generator, the same
draws at every ``wd``), less the same run at ``wd = 0`` (the control: it removes the
noise's own random walk). There Adam's ``v`` is set by the noise, so the decay's ``wd·w`` in
``m`` is not normalised away: the expected shrink per step is about
``lr·wd·w/√(1 + wd²w²)`` (``m ≈ wd·w``, ``v ≈ σ² + wd²w²``), the reference within 15 %. On
the one weight with no task gradient at all, Adam's normalised step is about ``lr`` whatever
``wd`` (shown, the case the text does not cover).

Setting (Uncertainty Weighting): the library's ``UncertaintyWeighting`` with one regression
and one classification task, fixed losses ``L = (4, 0.25)``, ``s = log σ²`` trained by
``torch.optim.Adam(lr=0.05, weight_decay=wd)`` for 500 steps (300 with ``--quick``; by 300
steps the weights sit within 1e-6 of the closed form, by 500 within 1e-11). The
weighted loss ``c·e^{−s}·L + s/2`` plus the decay's ``wd·s²/2`` is stationary where
``c·e^{−s}·L = ½ + wd·s``, solved here by bisection: that is the closed-form reference for
the learned weights ``c·e^{−s}``, which move from ``c/(2cL)`` toward ``c`` (0.5 and 1, the
weights at ``σ = 1``) as ``wd`` grows.

Setting (L2 in the loss): two conflicting tasks ``w₁`` and ``−w₁ + w₂`` at ``w = (1, 1)``, the
library's ``PCGrad``; ``½·0.5·‖w‖²`` added to task 1's loss lands in task 1's row of ``G``
(closed form ``(1.5, 0.5)``), so ``.grad`` is PCGrad of the penalised rows (the two-task
closed form of :mod:`._common`), not PCGrad of the plain rows plus the penalty.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import BALANCERS, get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import (
    Claim,
    grad_of,
    pcgrad_two,
    pyplot,
    require_attr,
    save_figure,
)

NAME = "weight_decay"
TITLE = "§9.2 Weight decay: Adam vs AdamW, and Uncertainty Weighting at σ = 1"
DECAYS = (0.01, 0.1, 1.0)
UW_DECAYS = (0.0, 0.1, 1.0, 10.0)
UW_LOSSES = (4.0, 0.25)
UW_FORMS = (0.5, 1.0)  # c for regression, classification
LR = 1e-3
STEPS = 200


def _optimizer_run(cls: Any, wd: float) -> tuple[list[float], Any]:
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    opt = cls([w], lr=LR, weight_decay=wd)
    buf = TaskGradBuffer([w], num_tasks=1)
    balancer = get_balancer("pcgrad" if "pcgrad" in BALANCERS else "sum")
    second, grads = [], []
    for _ in range(STEPS):
        buf.backward(torch.stack([w[0]]))
        buf.apply_(balancer)
        grads.append(grad_of(w).clone())
        opt.step()
        opt.zero_grad(set_to_none=True)
        second.append(float(w[1].detach()))
    return second, torch.stack(grads)


NOISY = 256


def _noisy_adam_shrink(wd: float) -> float:
    """Mean shrink per step of ``NOISY`` weights (start 1) whose task gradient is pure noise,
    under Adam (lr ``LR``, ``weight_decay`` ``wd``) for ``STEPS`` steps through the library."""
    w = torch.nn.Parameter(torch.ones(NOISY, dtype=torch.float64))
    opt = torch.optim.Adam([w], lr=LR, weight_decay=wd)
    buf = TaskGradBuffer([w], num_tasks=1)
    balancer = get_balancer("sum")
    gen = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        xi = torch.randn(NOISY, generator=gen, dtype=torch.float64)
        buf.backward(torch.stack([(xi * w).sum()]))
        buf.apply_(balancer)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return float(1.0 - w.detach().mean()) / STEPS


L2 = 0.5


def _l2_in_loss() -> dict[str, Any]:
    """PCGrad on two conflicting tasks (``w₁`` and ``−w₁ + w₂`` at ``w = (1, 1)``), once with
    ``L2/2·‖w‖²`` written into task 1's loss: the rows of ``G`` the balancer saw and the
    ``.grad`` it wrote, against the closed form and against decay added after it."""
    out: dict[str, Any] = {}
    for key, lam in (("plain", 0.0), ("penalty", L2)):
        w = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        buf = TaskGradBuffer([w], num_tasks=2)
        buf.backward(torch.stack([w[0] + lam / 2 * w.pow(2).sum(), -w[0] + w[1]]))
        matrix = buf.matrix
        assert matrix is not None
        out[key] = {"matrix": matrix.detach().clone(), "grad": None}
        buf.apply_(get_balancer("pcgrad" if "pcgrad" in BALANCERS else "sum"))
        out[key]["grad"] = grad_of(w).clone()
    rows = torch.tensor([[1.0 + L2, L2], [-1.0, 1.0]], dtype=torch.float64)
    out["row_gap"] = float((out["penalty"]["matrix"] - rows).abs().max())
    out["closed_gap"] = float((out["penalty"]["grad"] - pcgrad_two(rows)).abs().max())
    out["after_gap"] = float((out["penalty"]["grad"]
                              - (out["plain"]["grad"] + L2 * torch.ones(2))).norm())
    return out


def _stationary_weight(c: float, loss: float, wd: float) -> float:
    """``c·e^{−s}`` at the root of ``c·e^{−s}·L − ½ − wd·s`` (decreasing in ``s``)."""
    lo, hi = -50.0, 50.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if c * math.exp(-mid) * loss - 0.5 - wd * mid > 0:
            lo = mid
        else:
            hi = mid
    return c * math.exp(-(lo + hi) / 2)


def _uw_run(wd: float, steps: int) -> list[float]:
    uw_cls = require_attr("weighting", "UncertaintyWeighting")
    uw = uw_cls(2, task_types=["regression", "classification"], dtype=torch.float64)
    opt = torch.optim.Adam(uw.parameters(), lr=0.05, weight_decay=wd)
    losses = torch.tensor(UW_LOSSES, dtype=torch.float64)
    for _ in range(steps):
        uw(losses).sum().backward()
        opt.step()
        uw.update()
        opt.zero_grad(set_to_none=True)
    weights: list[float] = uw.weights.tolist()
    return weights


def compute(quick: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = {"adamw": {}, "adam": {}}
    grads = []
    for wd in DECAYS:
        for key, cls in (("adamw", torch.optim.AdamW), ("adam", torch.optim.Adam)):
            second, g = _optimizer_run(cls, wd)
            grads.append(g)
            result[key][wd] = {
                "series": second,
                "factor": (second[-1] / second[-2]),
                "per_step": (1.0 - second[-1]) / STEPS,
            }
    control = _noisy_adam_shrink(0.0)
    result["noisy_adam"] = {wd: _noisy_adam_shrink(wd) - control for wd in DECAYS}
    result["grad_diff"] = max(float((g - grads[0]).abs().max()) for g in grads)
    result["l2"] = _l2_in_loss()
    uw_cls = require_attr("weighting", "UncertaintyWeighting")
    at_one = uw_cls(2, task_types=["regression", "classification"], dtype=torch.float64)
    result["uw_sigma1"] = at_one.weights.tolist()
    steps = 300 if quick else 500
    result["uw"] = {wd: _uw_run(wd, steps) for wd in UW_DECAYS}
    result["uw_expected"] = {
        wd: [_stationary_weight(c, loss, wd) for c, loss in zip(UW_FORMS, UW_LOSSES)]
        for wd in UW_DECAYS
    }
    return result


def claims(result: dict[str, Any]) -> list[Claim]:
    adamw, adam = result["adamw"], result["adam"]
    exact = max(abs(adamw[wd]["factor"] - (1 - LR * wd)) for wd in DECAYS)
    adam_steps = [adam[wd]["per_step"] / LR for wd in DECAYS]
    l2 = result["l2"]
    noisy = [result["noisy_adam"][wd] / LR for wd in DECAYS]
    expected = [wd / math.sqrt(1 + wd * wd) for wd in DECAYS]
    uw, ref = result["uw"], result["uw_expected"]
    err = max(abs(uw[wd][k] / ref[wd][k] - 1) for wd in UW_DECAYS for k in range(2))
    big = UW_DECAYS[-1]
    adamw_steps = [adamw[wd]["per_step"] / LR for wd in DECAYS]
    wds = ", ".join(map(str, DECAYS))
    return [
        Claim("§9.2 decay acts inside opt.step(), after the balancer wrote the gradient: the "
              "balancer never sees it", f"balanced .grad identical across wd and optimizers "
              f"(max difference {result['grad_diff']:.1g})", result["grad_diff"] == 0.0),
        Claim("§9.2 AdamW shrinks the weights directly, by the learning rate times wd, outside "
              "m and v",
              "per-step factor " + ", ".join(f"{adamw[wd]['factor']:.6f}" for wd in DECAYS)
              + f" at wd {wds} (1 − lr·wd to {exact:.0e})", exact < 1e-12),
        Claim("§9.2 a larger wd shrinks them faster: holds for AdamW",
              "AdamW, a weight no task pushes: mean shrink per step / lr = "
              + ", ".join(f"{s:.4f}" for s in adamw_steps) + f" at wd {wds}",
              all(a < b for a, b in itertools.pairwise(adamw_steps))),
        Claim("§9.2 a larger wd shrinks them faster: Adam (weights whose task gradient is "
              f"batch noise, {NOISY} weights, {STEPS} steps)",
              "shrink per step / lr = " + ", ".join(f"{s:.4f}" for s in noisy)
              + f" at wd {wds}, less the wd = 0 control; expected wd/√(1 + wd²) = "
              + ", ".join(f"{e:.4f}" for e in expected),
              all(a < b for a, b in itertools.pairwise(noisy))
              and all(abs(s / e - 1) < 0.15 for s, e in zip(noisy, expected))),
        Claim("§9.2 (beyond the text) Adam on a weight with no task gradient at all: the "
              "per-coordinate scale normalises the decay with it",
              "shrink per step / lr = " + ", ".join(f"{s:.3f}" for s in adam_steps)
              + f" at wd {wds} (about 1 whatever wd)"),
        Claim(f"§9.2 an L2 penalty written into a task's loss does pass through the balancer "
              f"(PCGrad, two conflicting tasks, {L2:g}/2·‖w‖² in task 1's loss)",
              f"task 1's row of G holds it (to {l2['row_gap']:.0e}); .grad is PCGrad of those "
              f"rows (closed form to {l2['closed_gap']:.0e}), {l2['after_gap']:.3f} away from "
              f"PCGrad without it plus the penalty's gradient added after",
              l2["row_gap"] < 1e-12 and l2["closed_gap"] < 1e-12 and l2["after_gap"] > 0.01),
        Claim("§9.2 Uncertainty Weighting's weights at σ = 1 are 0.5 (regression) and 1 "
              "(classification)", f"{result['uw_sigma1'][0]:.4g}, {result['uw_sigma1'][1]:.4g}",
              result["uw_sigma1"] == [0.5, 1.0]),
        Claim("§9.2 decay on log σ pulls each weight toward its value at σ = 1",
              "learned weights " + "; ".join(f"wd {wd}: {uw[wd][0]:.3f}, {uw[wd][1]:.3f}"
                                             for wd in UW_DECAYS)
              + f" (closed form to {100 * err:.1f}%)",
              err < 0.03 and abs(uw[big][0] - 0.5) < abs(uw[0.0][0] - 0.5)
              and abs(uw[big][1] - 1.0) < abs(uw[0.0][1] - 1.0)),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for i, wd in enumerate(DECAYS):
        ax1.plot(result["adamw"][wd]["series"], color=f"C{i}", label=f"AdamW wd {wd}")
        ax1.plot(result["adam"][wd]["series"], color=f"C{i}", ls="--", label=f"Adam wd {wd}")
    ax1.set_xlabel("step")
    ax1.set_ylabel("weight with no task gradient")
    ax1.set_title("a weight no task pushes: wd matters under AdamW, not Adam", fontsize=10)
    ax1.legend(fontsize=8)
    wds = list(UW_DECAYS)
    xs = [max(wd, 0.01) for wd in wds]
    for k, (label, c) in enumerate((("regression", 0.5), ("classification", 1.0))):
        ax2.semilogx(xs, [result["uw"][wd][k] for wd in wds], "o", color=f"C{k}",
                     label=f"{label}: learned")
        ax2.semilogx(xs, [result["uw_expected"][wd][k] for wd in wds], "-", color=f"C{k}",
                     alpha=0.5, label=f"{label}: closed form")
        ax2.axhline(c, color=f"C{k}", ls=":", lw=0.8)
    ax2.set_xlabel("weight decay on log σ² (0 plotted at 0.01)")
    ax2.set_ylabel("Uncertainty Weighting weight")
    ax2.set_title("decay pulls toward σ = 1 (dotted)")
    ax2.legend(fontsize=8)
    fig.suptitle(TITLE)
    save_figure(fig, path)
