"""§9.3 A slow change of a task's weight under SGD and under Adam.

Setting: one regression task's head, a linear layer on 16 fixed features ``tanh(x W)``
(``x`` Gaussian, ``W`` seeded and not trained), targets ``φ·a + 0.5·noise``, batches of 32
drawn fresh every step. The task weight comes from the library's
``UncertaintyWeighting`` (regression: ``½·e^{−s}·L + s/2``, ``s = log σ²``), with ``s`` set on
a schedule instead of learned. Three copies of the head train side by side on the same
batches (one ``UncertaintyWeighting`` with a ``σ`` per copy): **constant** ``σ = 1``
(weight ½); **slow**: ``σ`` halves over 3,000 steps (log-linearly), so the weight grows ×4
gradually; **sudden**: ``σ`` halves at once. The heads start at the least-squares solution (so
their gradients are stationary noise from the first step), 200 steps at ``σ = 1`` come first,
3,000 after (``--quick``: 1,000 after, the slow change over 1,000). Optimizers:
``torch.optim.SGD(lr=0.05)`` and ``torch.optim.Adam(lr=1e-3)``, elementwise, so the copies
never mix.

Measured: each copy's head step ``‖Δθ‖`` over the constant copy's, averaged over 100-step
bins, against the weight ratio (×4 once the change is done); the numbers are means over the
last 300 steps of the slow change, over steps 10–60 after the sudden one, and over the last
300 steps. Under SGD the step is ``lr·w·∇L``, so the ratio follows the weight. Under Adam,
with a gradient ``wₜ·ξₜ`` (the heads sit at the least-squares solution, so ``ξ`` is noise),
``m`` averages the recent ``wⱼ²`` over about 10
steps and ``v`` over about 1,000: the closed form (:func:`predicted_ratio`) is the ratio of
the two averages' square roots against the constant copy's. For a weight growing as
``e^{rt}`` it tends to ``√(1 + 2r/(1 − β₂))`` (1.39 for ×4 over 3,000 steps) instead of ×4;
a sudden ×4 passes through until ``v`` catches up (time constant ``1/(1 − β₂)`` = 1,000
steps, shorter just after the start, where ``v``'s bias correction still weighs the few
steps it has). The Uncertainty Weighting paper's own observation (all three σ fell under
SGD with momentum, and the learning rate was lowered on a schedule) is a report of its runs,
not re-measured here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from gradbalance_lab.figures._common import Claim, pyplot, require_attr, save_figure

NAME = "adam_absorb"
TITLE = "§9.3 A task weight growing ×4 under SGD and Adam"
FEATURES = 16
FACTOR = 4.0
BIN = 100
COPIES = ("constant", "slow", "sudden")
OPTIMIZERS: dict[str, tuple[str, Any]] = {
    "sgd": ("SGD (lr 0.05)", lambda p: torch.optim.SGD([p], lr=0.05)),
    "adam": ("Adam (lr 1e-3)", lambda p: torch.optim.Adam([p], lr=1e-3)),
}


def _schedule(warm: int, change: int, after: int) -> torch.Tensor:
    """``s = log σ²`` per step and copy: ``[warm + after, 3]``."""
    total = warm + after
    t = torch.arange(total, dtype=torch.float64)
    low = -math.log(FACTOR)
    slow = torch.where(t < warm, 0.0, (low * (t - warm + 1) / change).clamp(min=low))
    sudden = torch.where(t < warm, 0.0, low)
    return torch.stack([torch.zeros(total, dtype=torch.float64), slow, sudden], dim=1)


def _run(schedule: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per optimizer: head step sizes ``[steps, 3]`` and the weights used ``[steps, 3]``. The
    copies of both optimizers share the batches, one ``UncertaintyWeighting`` (a ``σ`` per
    copy) and one backward pass per step; each optimizer steps its own copies."""
    uw_cls = require_attr("weighting", "UncertaintyWeighting")
    n = len(COPIES)
    uw = uw_cls(n * len(OPTIMIZERS), task_types="regression", dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    layer = torch.randn(8, FEATURES, generator=gen, dtype=torch.float64) / math.sqrt(8)
    target = torch.randn(FEATURES, generator=gen, dtype=torch.float64)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(schedule.shape[0], 32, 8, generator=data, dtype=torch.float64)
    phi = torch.tanh(x @ layer)
    y = phi @ target + 0.5 * torch.randn(x.shape[:2], generator=data, dtype=torch.float64)
    flat_phi, flat_y = phi.reshape(-1, FEATURES), y.reshape(-1, 1)
    best = torch.linalg.lstsq(flat_phi, flat_y).solution.reshape(-1)
    heads = {key: torch.nn.Parameter(best.repeat(n, 1)) for key in OPTIMIZERS}
    opts = {key: make(heads[key]) for key, (_, make) in OPTIMIZERS.items()}
    total = schedule.shape[0]
    steps = torch.empty(total, n * len(OPTIMIZERS), dtype=torch.float64)
    weights = torch.empty_like(steps)
    every = schedule.repeat(1, len(OPTIMIZERS))
    params: list[torch.Tensor] = [*heads.values()]
    for t in range(total):
        with torch.no_grad():
            uw.log_vars.copy_(every[t])
        stacked = torch.cat(params)
        losses = ((phi[t] @ stacked.T - y[t, :, None]) ** 2).mean(dim=0)  # one per copy
        before = stacked.detach()
        uw(losses).sum().backward(inputs=[*params, uw.log_vars])
        for opt in opts.values():
            opt.step()
        uw.update()
        for opt in opts.values():
            opt.zero_grad(set_to_none=True)
        uw.log_vars.grad = None
        steps[t] = (torch.cat(params).detach() - before).norm(dim=1)
        weights[t] = uw.weights
    return {key: (steps[:, i * n:(i + 1) * n], weights[:, i * n:(i + 1) * n])
            for i, key in enumerate(OPTIMIZERS)}


def predicted_ratio(weights: torch.Tensor, beta1: float = 0.9,
                    beta2: float = 0.999) -> list[float]:
    """Adam's step ratio per step for a gradient ``wₜ·ξₜ`` (``ξ`` white noise) against the same
    noise at the constant weight ``weights[0]``: ``√(Σ β₁^{2(t−j)} wⱼ² / Σ β₁^{2(t−j)} w₀²)``
    (the size of ``m``) over ``√(Σ β₂^{t−j} wⱼ² / Σ β₂^{t−j} w₀²)`` (``√v``); the bias
    corrections are the same for both and cancel."""
    out = []
    m = m0 = v = v0 = 0.0
    w0 = float(weights[0]) ** 2
    for w in weights.tolist():
        m, m0 = beta1**2 * m + w * w, beta1**2 * m0 + w0
        v, v0 = beta2 * v + w * w, beta2 * v0 + w0
        out.append(math.sqrt(m / m0) / math.sqrt(v / v0))
    return out


def _bins(values: torch.Tensor) -> torch.Tensor:
    n = values.shape[0] // BIN
    return values[: n * BIN].reshape(n, BIN, -1).mean(dim=1)


def compute(quick: bool = False) -> dict[str, Any]:
    warm, change, after = (200, 1000, 1000) if quick else (200, 3000, 3000)
    schedule = _schedule(warm, change, after)
    result: dict[str, Any] = {"warm": warm, "change": change, "after": after, "bin": BIN}
    end = slice(warm + change - 300, warm + change)
    jump = slice(warm + 10, warm + 60)
    for key, (steps, weights) in _run(schedule).items():
        binned = _bins(steps)
        ratio = binned[:, 1:] / binned[:, :1]
        w_ratio = _bins(weights)[:, 1:] / _bins(weights)[:, :1]
        result[key] = {
            "ratio_slow": ratio[:, 0].tolist(), "ratio_sudden": ratio[:, 1].tolist(),
            "weight_slow": w_ratio[:, 0].tolist(), "weight_sudden": w_ratio[:, 1].tolist(),
            "slow_end": float(steps[end, 1].mean() / steps[end, 0].mean()),
            "slow_weight": float((weights[end, 1] / weights[end, 0]).mean()),
            "sudden_early": float(steps[jump, 2].mean() / steps[jump, 0].mean()),
            "sudden_end": float(steps[-300:, 2].mean() / steps[-300:, 0].mean()),
            "before": float(steps[:warm, 1].mean() / steps[:warm, 0].mean()),
        }
        predicted = torch.tensor([predicted_ratio(weights[:, c]) for c in (1, 2)]).T
        if key == "adam":
            result["predicted"] = {
                "slow_end": float(predicted[end, 0].mean()),
                "sudden_early": float(predicted[jump, 1].mean()),
                "sudden_end": float(predicted[-300:, 1].mean()),
                "slow": _bins(predicted[:, :1])[:, 0].tolist(),
                "sudden": _bins(predicted[:, 1:])[:, 0].tolist()}
    rate = math.log(FACTOR) / change
    result["limit_adam"] = math.sqrt(1 + 2 * rate / (1 - 0.999))
    return result


def claims(result: dict[str, Any]) -> list[Claim]:
    sgd, adam, pred = result["sgd"], result["adam"], result["predicted"]
    change = result["change"]
    absorbed = 1 - math.log(adam["slow_end"]) / math.log(adam["slow_weight"])

    def near(measured: float, closed: float) -> bool:
        return abs(measured / closed - 1) < 0.15

    return [
        Claim(f"§9.3 under SGD a task weight growing ×{FACTOR:g} (σ halving over {change} "
              f"steps) grows the head's step with it (a learning-rate change)",
              f"head step / the constant copy's over the last 300 steps of the change: "
              f"{sgd['slow_end']:.2f}, weight ratio there {sgd['slow_weight']:.2f}",
              near(sgd["slow_end"], sgd["slow_weight"])),
        Claim("§9.3 under Adam the per-coordinate scale on a task's head largely absorbs a slow "
              "weight change",
              f"head step ratio {adam['slow_end']:.2f} against a weight ratio of "
              f"{adam['slow_weight']:.2f} ({100 * absorbed:.0f}% absorbed, in log terms); "
              f"closed form {pred['slow_end']:.2f}",
              absorbed > 0.5 and near(adam["slow_end"], pred["slow_end"])),
        Claim("§9.3 ... a sudden change is not absorbed at once: it passes through until v "
              "catches up",
              f"Adam, weight ×{FACTOR:g} at once: head step ratio {adam['sudden_early']:.2f} "
              f"over steps 10–60 after it (closed form {pred['sudden_early']:.2f}), "
              f"{adam['sudden_end']:.2f} over the last 300 of {result['after']} (closed form "
              f"{pred['sudden_end']:.2f}); SGD: {sgd['sudden_early']:.2f}, "
              f"{sgd['sudden_end']:.2f}",
              near(adam["sudden_early"], pred["sudden_early"])
              and near(adam["sudden_end"], pred["sudden_end"])
              and adam["sudden_early"] > 1.5 * adam["sudden_end"]),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    b = result["bin"]
    for ax, (key, (label, _)) in zip(axes, OPTIMIZERS.items()):
        run = result[key]
        xs = [(i + 0.5) * b - result["warm"] for i in range(len(run["ratio_slow"]))]
        ax.semilogy(xs, run["weight_slow"], "k:", lw=1, label="weight ratio, slow")
        ax.semilogy(xs, run["weight_sudden"], "k--", lw=1, label="weight ratio, sudden")
        ax.semilogy(xs, run["ratio_slow"], "o-", ms=3, color="C0",
                    label="head step ratio, slow change")
        ax.semilogy(xs, run["ratio_sudden"], "s-", ms=3, color="C1",
                    label="head step ratio, sudden change")
        if key == "adam":
            pred = result["predicted"]
            ax.semilogy(xs, pred["slow"], color="C0", lw=2, alpha=0.35,
                        label="closed form, slow")
            ax.semilogy(xs, pred["sudden"], color="C1", lw=2, alpha=0.35,
                        label="closed form, sudden")
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_xlabel("steps since σ started to fall")
        ax.set_title(label, fontsize=10)
        ax.set_ylim(0.8, 9)
        ax.set_yticks([1, 2, 4, 8], ["1", "2", "4", "8"])
        ax.set_yticks([], minor=True)
        ax.legend(fontsize=8, loc="upper left", ncol=2)
    for ax in axes:
        ax.set_ylabel(f"step or weight over the constant copy's ({b}-step means, log)",
                      fontsize=9)
        ax.tick_params(labelleft=True)
    fig.suptitle(TITLE)
    save_figure(fig, path)
