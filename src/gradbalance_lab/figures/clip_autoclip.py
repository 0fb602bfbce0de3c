"""Clip tutorial, Relatives and variants: AutoClip, a threshold tracked from the norm history.

Seetharaman et al. (2020), AutoClip: at step t the limit is the p-th percentile of every
gradient norm seen so far, the current one included. Setting: a 3-task model (MLP trunk
8→32→32, linear heads, targets scaled 1, 3, 0.3; 512 samples, batch 32; as ``clip_threshold``),
the library's step (:class:`~gradbalance.TaskGradBuffer`, ``Mean`` balancer), SGD (lr 0.01)
and :class:`gradbalance.clip.AutoClip` with the paper's p = 10, for 200 steps (50 with
``--quick``).

Checked every step, independently of the library: the threshold against the p-th percentile
of the returned pre-clip norms so far (linear interpolation between order statistics, done
here by sorting; float64, so the two agree to rounding), and the factor the gradient was
multiplied by (float64 norms of the float32 gradient after and before) against
``min(1, τₜ/(‖g‖ + ε))`` (the factor is rounded to float32 once, and so is each product).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.clip import AutoClip
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "clip_autoclip"
TITLE = "Clip tutorial, Relatives and variants: AutoClip (a percentile of the norm history)"
PERCENTILE = 10.0
F32 = 2.0**-24
EPS = 1e-6


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step has set."""
    assert p.grad is not None
    return p.grad


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), written out independently."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _flat64(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([_grad(p).reshape(-1) for p in model.parameters()]).double()


def compute(quick: bool = False) -> dict[str, Any]:
    steps = 50 if quick else 200
    data = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=data)
    targets = torch.stack([(x @ torch.randn(8, generator=data)) * s for s in (1.0, 3.0, 0.3)],
                          dim=1)
    torch.manual_seed(0)
    model = MultiTaskModel(mlp_trunk(8, 32, 2), make_heads(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer("mean")
    clipper = AutoClip(percentile=PERCENTILE, history_size=1000)
    gen = torch.Generator().manual_seed(1)
    norms: list[float] = []
    out: dict[str, list[float]] = {"norm": [], "threshold": [], "reference": [], "after": [],
                                 "factor": []}
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        buf.backward(regression_losses(model(x[idx]), targets[idx]))
        buf.apply_(balancer)
        before = _flat64(model)
        norm = float(clipper(model.parameters()))
        norms.append(norm)
        assert clipper.threshold is not None
        out["norm"].append(norm)
        out["threshold"].append(float(clipper.threshold[0]))
        out["reference"].append(percentile(norms, PERCENTILE))
        after = _flat64(model)
        out["after"].append(float(after.norm()))
        out["factor"].append(float(after.norm() / before.norm()))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"steps": steps, "percentile": PERCENTILE, **out}


def claims(result: dict[str, Any]) -> list[Claim]:
    thr_gap = max(abs(t - r) / r for t, r in zip(result["threshold"], result["reference"]))
    after_gap = max(abs(f - min(1.0, t / (n + EPS))) / min(1.0, t / (n + EPS))
                    for f, n, t in zip(result["factor"], result["norm"], result["threshold"]))
    clipped = sum(n > t for n, t in zip(result["norm"], result["threshold"]))
    steps = result["steps"]
    return [
        Claim("§Relatives and variants: adaptive clipping — thresholds tracked from the "
              "gradient-norm history (AutoClip, Seetharaman et al. 2020)",
              f"{steps} steps, p = {result['percentile']:g}: threshold vs the percentile of "
              f"the norms so far (sorted here): largest relative gap {thr_gap:.1e}; "
              f"threshold {result['threshold'][0]:.3g} → {result['threshold'][-1]:.3g}",
              thr_gap < 1e-12),
        Claim("§Relatives and variants: AutoClip caps each step at its tracked threshold, "
              "g ← g·min(1, τₜ/(‖g‖ + ε))",
              f"factor applied (float64 norms after/before) vs that formula: largest relative "
              f"gap {after_gap:.1e}; {clipped} of {steps} steps clipped",
              after_gap <= 4 * F32),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    steps = range(len(result["norm"]))
    ax.plot(steps, result["norm"], lw=0.8, color="grey", label="pre-clip norm ‖g‖")
    ax.plot(steps, result["threshold"], color="C3", lw=1.5,
            label=f"AutoClip threshold τₜ (p{result['percentile']:g} of the history)")
    ax.plot(steps, result["reference"], color="k", ls=":", lw=1.2,
            label="percentile of the norms so far (sorted independently)")
    ax.plot(steps, result["after"], color="C0", lw=0.8, label="post-clip norm")
    ax.set_yscale("log")
    ax.set_ylim(min(result["after"]) * 0.8, max(result["norm"]) * 3)
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm (log)")
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title(TITLE, fontsize=10)
    save_figure(fig, path)
