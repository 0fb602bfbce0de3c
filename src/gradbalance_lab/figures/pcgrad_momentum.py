"""§8.1 PCGrad with heavy-ball momentum on two strongly convex losses.

Setting: the two-bowl example of :mod:`._common` (strongly convex, exact gradients), eight
starts on a circle of radius 4 around (1.5, 1.5) (four with ``--quick``); the library's
``PCGrad`` through :class:`~gradbalance.TaskGradBuffer`, then
``torch.optim.SGD(lr=0.01, momentum=0.9)`` (PyTorch's heavy ball) for 3,000 steps (500
with ``--quick``). On the quadratic the heavy ball contracts by ``√0.9 ≈ 0.95`` per step on
both axes, so the step size is tuned in the sense of the theorem.

The PCGrad paper (Theorem 4, Appendix A.4) says the iterates reach either the optimum of
``L₁ + L₂`` or a point where the two gradients point exactly opposite. At each end point the
exact gradients give ``‖g₁ + g₂‖`` and ``1 + cos(g₁, g₂)``; the claim holds when either is 0
(to 1e-6).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from gradbalance_lab.figures._common import (
    BOWL_CENTERS,
    Claim,
    TwoBowls,
    pyplot,
    require_balancer,
    save_figure,
)

NAME = "pcgrad_momentum"
TITLE = "§8.1 PCGrad + heavy-ball momentum (two strongly convex bowls)"
TOL = 1e-6


def compute(quick: bool = False) -> dict[str, Any]:
    starts = 4 if quick else 8
    steps = 500 if quick else 3000
    runs = []
    for i in range(starts):
        phi = 2 * math.pi * (i + 0.5) / starts
        start = (1.5 + 4 * math.cos(phi), 1.5 + 4 * math.sin(phi))
        bowls = TwoBowls(start=start)
        path = bowls.train(require_balancer("pcgrad"),
                           lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), steps,
                           record_every=5)
        g = bowls.exact_gradients()
        cos = float(g[0] @ g[1] / (g[0].norm() * g[1].norm()))
        runs.append({"start": start, "x": path["x"], "y": path["y"],
                     "end": [path["x"][-1], path["y"][-1]],
                     "sum_norm": float(g.sum(dim=0).norm()), "one_plus_cos": 1 + cos,
                     "pareto": path["pareto"][-1]})
    return {"runs": runs, "steps": steps}


def claims(result: dict[str, Any]) -> list[Claim]:
    runs = result["runs"]
    worst = max(min(r["sum_norm"], r["one_plus_cos"]) for r in runs)
    at_opt = sum(r["sum_norm"] < TOL for r in runs)
    opposed = sum(r["one_plus_cos"] < TOL for r in runs)
    return [
        Claim("PCGrad with heavy-ball momentum reaches the optimum or a point where the two "
              "gradients point exactly opposite",
              f"{len(runs)} starts, {result['steps']} steps: {at_opt} at the optimum of the "
              f"sum, {opposed} with opposed gradients; worst min(‖g₁+g₂‖, 1+cos) = {worst:.1e}",
              worst < TOL),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 6))
    (x1, y1), (x2, y2) = BOWL_CENTERS
    ax.plot([x1, x2], [y1, y2], "k-", lw=3, alpha=0.3, label="gradients opposed (Pareto set)")
    for i, run in enumerate(result["runs"]):
        ax.plot(run["x"], run["y"], color=f"C{i}", lw=1)
        ax.plot(*run["start"], "s", color=f"C{i}")
        ax.plot(*run["end"], "o", color=f"C{i}")
    ax.set_aspect("equal")
    ax.set_xlabel("weight 1")
    ax.set_ylabel("weight 2")
    ax.set_title(TITLE, fontsize=10)
    ax.legend(loc="upper left")
    save_figure(fig, path)
