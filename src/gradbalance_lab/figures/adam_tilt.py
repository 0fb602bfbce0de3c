"""§7.2 Tilt of Adam's step: PCGrad under SGD and under Adam on the two-bowl example.

Setting: the two-bowl example of :mod:`._common` (bowls lowest at (3, 0) and (0, 3),
``H = diag(10, 1)``, exact gradients), started at (5, 5), equally far from both minima.
The library's ``PCGrad`` balancer through :class:`~gradbalance.TaskGradBuffer`, then
``torch.optim.SGD(lr=0.01)`` or ``torch.optim.Adam(lr=0.01)`` for 20,000 steps (1,000 with
``--quick``). Both bowls share ``H``, so the Pareto set is the segment from (3, 0) to (0, 3).

Measured: the distance of each end point to the Pareto set, where on it each lands, and the
tilt, the angle between the optimizer's step and the balanced gradient PCGrad handed over,
over the approach (until the path is within 0.05 of the Pareto set). SGD's tilt is 0 by
construction; Adam divides each coordinate by its own scale, so its step points near
``(±1, ±1)`` whatever the balancer's direction.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from gradbalance_lab.figures._common import (
    BOWL_CENTERS,
    BOWL_CURVATURE,
    Claim,
    TwoBowls,
    pyplot,
    require_balancer,
    save_figure,
)

NAME = "adam_tilt"
TITLE = "§7.2 PCGrad under SGD and Adam: the two-bowl example"
START = (5.0, 5.0)
LR = 0.01
EVERY = 10


def _approach_tilt(run: dict[str, list[float]]) -> float:
    """Median tilt over the steps before the path first comes within 0.05 of the set."""
    reached = next((i for i, d in enumerate(run["pareto"]) if d < 0.05), len(run["pareto"]))
    steps = max(1, reached * EVERY)
    return statistics.median(run["tilt"][:steps])


def compute(quick: bool = False) -> dict[str, Any]:
    steps = 1000 if quick else 20000
    result: dict[str, Any] = {"steps": steps}
    for opt_name, make in (("sgd", lambda p: torch.optim.SGD(p, lr=LR)),
                           ("adam", lambda p: torch.optim.Adam(p, lr=LR))):
        bowls = TwoBowls(start=START)
        run = bowls.train(require_balancer("pcgrad"), make, steps, record_every=EVERY)
        result[opt_name] = {
            "x": run["x"], "y": run["y"], "end": [run["x"][-1], run["y"][-1]],
            "pareto_end": run["pareto"][-1], "tilt": _approach_tilt(run),
            "tilt_series": run["tilt"][:: max(1, steps // 2000)],
        }
    sgd_end = torch.tensor(result["sgd"]["end"])
    adam_end = torch.tensor(result["adam"]["end"])
    result["end_gap"] = float((sgd_end - adam_end).norm())
    return result


def claims(result: dict[str, Any]) -> list[Claim]:
    sgd, adam = result["sgd"], result["adam"]

    def at(r: dict[str, Any]) -> str:
        return f"({r['end'][0]:.3f}, {r['end'][1]:.3f}), {r['pareto_end']:.1e} from the set"

    return [
        Claim(f"PCGrad + SGD (lr 0.01, {result['steps']} steps) ends on the Pareto set",
              at(sgd), sgd["pareto_end"] < 1e-3),
        Claim(f"PCGrad + Adam (lr 0.01, {result['steps']} steps) ends on the Pareto set too "
              "(within a step length)", at(adam), adam["pareto_end"] < LR),
        Claim("Adam tilts the step away from PCGrad's direction (median over the approach)",
              f"Adam {adam['tilt']:.1f}°, SGD {sgd['tilt']:.1g}°",
              adam["tilt"] > 5 and sgd["tilt"] < 1e-3),
        Claim("... so Adam lands elsewhere on the Pareto set",
              f"end points {result['end_gap']:.2f} apart", result["end_gap"] > 0.1),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 6))
    grid = torch.linspace(-1.5, 5.5, 200, dtype=torch.float64)
    xx, yy = torch.meshgrid(grid, grid, indexing="xy")
    h = BOWL_CURVATURE
    for (cx, cy), color in zip(BOWL_CENTERS, ("C0", "C1")):
        loss = 0.5 * (h[0] * (xx - cx) ** 2 + h[1] * (yy - cy) ** 2)
        ax.contour(xx.numpy(), yy.numpy(), loss.numpy(), levels=[1, 4, 16, 64],
                   colors=color, alpha=0.3, linewidths=0.8)
    (x1, y1), (x2, y2) = BOWL_CENTERS
    ax.plot([x1, x2], [y1, y2], "k-", lw=3, alpha=0.3, label="Pareto set")
    for key, label, color in (("sgd", "PCGrad + SGD", "C2"), ("adam", "PCGrad + Adam", "C3")):
        run = result[key]
        ax.plot(run["x"], run["y"], color=color, label=f"{label} (tilt {run['tilt']:.0f}°)")
        ax.plot(*run["end"], "o", color=color)
    ax.plot(*START, "ks")
    ax.set_aspect("equal")
    ax.set_xlabel("weight 1 (10× steeper)")
    ax.set_ylabel("weight 2")
    ax.set_title(TITLE, fontsize=10)
    ax.legend(loc="upper left")
    save_figure(fig, path)
