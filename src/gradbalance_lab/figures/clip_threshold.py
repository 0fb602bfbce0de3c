"""Clip tutorial, Choosing the limit: the 90th–95th percentile of a logged run's norms.

Setting: a 3-task regression model (MLP trunk 8→32→32, linear heads, targets scaled 1, 3,
0.3; 512 samples, batch 32), the library's step (:class:`~gradbalance.TaskGradBuffer`,
``Mean`` balancer) and plain SGD (lr 0.01), so a clip factor is a factor on the learning rate.

1. An unclipped run of 200 steps (50 with ``--quick``) logs the pre-clip norms
   (``clip_grad_norm_(max_norm=inf)``); :func:`gradbalance.clip.suggest_max_norm` gives its
   90th and 95th percentiles and, as the "brutally low" limit, its 10th.
2. A fresh run (same data and initial weights, another batch order) is trained with
   ``clip_grad_norm_`` at each of the three limits: how often it clips, the mean factor
   ``min(1, τ/‖g‖)`` (the share of the learning rate left), and its loss on all 512
   samples (every 5 steps).

Tolerance: if the fresh run's norms came from the logged run's distribution, the share of
steps above the q-th percentile would be binomial with mean 1 − q/100; the verdict allows 3
standard deviations, ``3·√(p(1−p)/n)`` over n steps.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.clip import suggest_max_norm
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "clip_threshold"
TITLE = "Clip tutorial, Choosing the limit: the 90th–95th percentile of logged norms"
LR = 0.01
PERCENTILES = (95, 90, 10)


def train(steps: int, tau: float = math.inf, batch_seed: int = 0) -> dict[str, list[float]]:
    """SGD run clipped at ``tau``: per step the pre-clip norm; every 5 steps (and at the end)
    the mean task loss on all 512 samples."""
    data = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=data)
    targets = torch.stack([(x @ torch.randn(8, generator=data)) * s for s in (1.0, 3.0, 0.3)],
                          dim=1)
    torch.manual_seed(0)
    model = MultiTaskModel(mlp_trunk(8, 32, 2), make_heads(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer("mean")
    gen = torch.Generator().manual_seed(batch_seed)
    norms: list[float] = []
    losses: list[float] = []
    at: list[float] = []
    for t in range(steps + 1):
        if t % 5 == 0 or t == steps:
            with torch.no_grad():
                losses.append(float(regression_losses(model(x), targets).mean()))
            at.append(float(t))
        if t == steps:
            break
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        buf.backward(regression_losses(model(x[idx]), targets[idx]))
        buf.apply_(balancer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), tau)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {"norms": norms, "losses": losses, "at": at}


def compute(quick: bool = False) -> dict[str, Any]:
    steps = 50 if quick else 200
    logged = train(steps)
    runs = {}
    for q in PERCENTILES:
        tau = suggest_max_norm(logged["norms"], percentile=q)
        run = train(steps, tau, batch_seed=1)
        norms = run["norms"]
        runs[q] = {"tau": tau, "norms": norms, "losses": run["losses"], "at": run["at"],
                   "share": sum(n > tau for n in norms) / steps,
                   "factor": statistics.fmean(min(1.0, tau / n) for n in norms),
                   "end_loss": run["losses"][-1]}
    return {"steps": steps, "logged": logged, "runs": runs}


def _band(p: float, n: int) -> float:
    """3 binomial standard deviations of a share p over n steps."""
    return 3 * math.sqrt(p * (1 - p) / n)


def claims(result: dict[str, Any]) -> list[Claim]:
    n = result["steps"]
    r95, r90, r10 = (result["runs"][q] for q in PERCENTILES)
    return [
        Claim("§Choosing the limit: set the limit around the 90th–95th percentile of healthy "
              "values — the governor catches runaways, not every step",
              f"fresh run of {n} steps: τ = p95 = {r95['tau']:.4g} clips "
              f"{100 * r95['share']:.1f}% of steps (bound 5 + {100 * _band(0.05, n):.1f}%), "
              f"τ = p90 = {r90['tau']:.4g} clips {100 * r90['share']:.1f}% (bound 10 + "
              f"{100 * _band(0.10, n):.1f}%); mean factor {r95['factor']:.3f}, "
              f"{r90['factor']:.3f}",
              r95["share"] <= 0.05 + _band(0.05, n) and r90["share"] <= 0.10 + _band(0.10, n)),
        Claim("§Choosing the limit: a limit that clips constantly is quietly shrinking your "
              "effective learning rate",
              f"τ = p10 = {r10['tau']:.4g} clips {100 * r10['share']:.0f}% of steps; mean "
              f"factor {r10['factor']:.3f}: SGD at lr {LR} runs at about "
              f"{LR * r10['factor']:.2g}",
              r10["share"] >= 0.90 - _band(0.10, n) and r10["factor"] < r95["factor"]),
        Claim("§Common mistakes (limit brutally low): every update is rescaled — training slows",
              f"loss on all 512 samples after {n} steps (same batches): "
              f"{r10['end_loss']:.3g} at p10 vs {r95['end_loss']:.3g} at p95 "
              f"(unclipped run: {result['logged']['losses'][-1]:.3g})",
              r10["end_loss"] > r95["end_loss"]),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    logged = result["logged"]["norms"]
    ax1.plot(logged, lw=0.8, color="grey", label="pre-clip norm, unclipped run (logged)")
    for q, color in zip(PERCENTILES, ("C0", "C2", "C3")):
        run = result["runs"][q]
        ax1.axhline(run["tau"], color=color, ls="--",
                    label=f"τ = p{q} = {run['tau']:.3g}: clips {100 * run['share']:.0f}% "
                          f"of a fresh run")
    ax1.set_yscale("log")
    ax1.set_ylim(min(logged) * 0.7, max(logged) * 5)
    ax1.set_xlabel("step")
    ax1.set_ylabel("gradient norm (log)")
    ax1.legend(fontsize=8, loc="upper right")
    ax1.set_title("limits from the logged norms")
    for q, color in zip(PERCENTILES, ("C0", "C2", "C3")):
        run = result["runs"][q]
        ax2.plot(run["at"], run["losses"], lw=1.2, color=color,
                 label=f"clipped at p{q} (mean factor {run['factor']:.2f})")
    ax2.plot(result["logged"]["at"], result["logged"]["losses"], lw=1.2, color="grey", ls=":",
             label="unclipped (logged run)")
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_ylabel("mean task loss on all 512 samples (log)")
    ax2.legend(fontsize=8, loc="lower left")
    ax2.set_title("a limit that clips every step slows training (SGD)")
    fig.suptitle(TITLE)
    save_figure(fig, path)
