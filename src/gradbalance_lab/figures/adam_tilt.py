"""§7.2 Tilt of Adam's step: PCGrad under SGD and under Adam on the two-bowl example.

Setting: the two-bowl example of :mod:`._common` (bowls lowest at (3, 0) and (0, 3),
``H = diag(10, 1)``, exact gradients), started at (5, 5), equally far from both minima.
The library's ``PCGrad`` balancer, then ``torch.optim.SGD(lr=0.01)`` or
``torch.optim.Adam(lr=0.01)`` for 20,000 steps (1,000 with ``--quick``). Both bowls share
``H``, so the Pareto set is the segment from (3, 0) to (0, 3).

The runs use the batched two-task PCGrad of :mod:`._common`; the figure checks it against the
library (``PCGrad`` on the matrices of the run, and :class:`~gradbalance.TaskGradBuffer` with
``PCGrad`` over the first 300 steps of both runs, 100 with ``--quick``). A run stops early
once it sits still at a point where PCGrad hands over an exactly zero gradient: every later
step of the 20,000 is zero (the number of steps actually taken is reported).

Measured: the distance of each end point to the Pareto set, where on it each lands, and the
tilt, the angle between the optimizer's step and the balanced gradient PCGrad handed over,
over the approach (until the path is within 0.05 of the Pareto set). SGD's tilt is 0 by
construction; Adam divides each coordinate by its own scale, so its step points near
``(±1, ±1)`` whatever the balancer's direction. §7's "tilts every step" is measured as the
share of the approach's steps whose tilt exceeds 1° (fixed before measuring: a hundred
thousand times the rounding of the angle), against the text's 100 %.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gradbalance_lab.figures._common import (
    BOWL_CENTERS,
    BOWL_CURVATURE,
    Claim,
    TwoBowls,
    angles_deg,
    kernel_gap,
    pareto_distances,
    pyplot,
    require_balancer,
    save_figure,
    train_bowls,
)

NAME = "adam_tilt"
TITLE = "§7.2 PCGrad under SGD and Adam: the two-bowl example"
START = (5.0, 5.0)
LR = 0.01
NEAR = 0.05
TILTED = 1.0  # degrees: a step tilted by more than this counts as tilted


def _optimizers() -> dict[str, Any]:
    return {"sgd": lambda p: torch.optim.SGD(p, lr=LR),
            "adam": lambda p: torch.optim.Adam(p, lr=LR)}


def compute(quick: bool = False) -> dict[str, Any]:
    steps = 1000 if quick else 20000
    check = 100 if quick else 300
    result: dict[str, Any] = {"steps": steps, "check_steps": check}
    start = torch.tensor([START], dtype=torch.float64)
    gaps = []
    for name, make in _optimizers().items():
        require_balancer("pcgrad")
        run = train_bowls(start, "pcgrad", make, steps, until_still=True)
        path = run["path"][:, 0]
        moved = path[:-1] - path[1:]
        tilt = angles_deg(moved, run["handed"][:, 0])
        pareto = pareto_distances(path)
        near = (pareto < NEAR).nonzero()
        reached = int(near[0]) if len(near) else len(pareto) - 1
        library = TwoBowls(start=START).train(require_balancer("pcgrad"), make, check)
        lib_path = torch.tensor([library["x"], library["y"]], dtype=torch.float64).T
        result[name] = {
            "x": path[:, 0].tolist(), "y": path[:, 1].tolist(),
            "end": path[-1].tolist(), "pareto_end": float(pareto[-1]),
            "tilt": float(tilt[:max(1, reached)].median()),
            "tilted_share": float((tilt[:max(1, reached)] > TILTED).double().mean()),
            "tilt_series": tilt[:max(1, reached)].tolist(),
            "steps_run": int(run["steps_run"]), "reached": reached,
            "library_gap": float((lib_path - path[1:check + 1]).abs().max()),
        }
        gaps.append(kernel_gap("pcgrad", run["matrices"]))
    result["kernel_gap"] = max(gaps)
    sgd_end = torch.tensor(result["sgd"]["end"])
    adam_end = torch.tensor(result["adam"]["end"])
    result["end_gap"] = float((sgd_end - adam_end).norm())
    return result


def claims(result: dict[str, Any]) -> list[Claim]:
    sgd, adam = result["sgd"], result["adam"]
    steps = result["steps"]

    def at(r: dict[str, Any]) -> str:
        still = (f"; unchanged after step {r['steps_run']}" if r["steps_run"] < steps
                 else "")
        return (f"({r['end'][0]:.3f}, {r['end'][1]:.3f}), {r['pareto_end']:.1e} from the "
                f"set{still}")

    lib = max(sgd["library_gap"], adam["library_gap"])
    return [
        Claim(f"§7.2 PCGrad + SGD (lr 0.01, {steps} steps) ends on the Pareto set",
              at(sgd), sgd["pareto_end"] < 1e-3),
        Claim(f"§7.2 PCGrad + Adam (lr 0.01, {steps} steps) ends on the Pareto set too "
              "(within a step length)", at(adam), adam["pareto_end"] < LR),
        Claim("§7.2 Adam tilts the step away from PCGrad's direction (median over the approach)",
              f"Adam {adam['tilt']:.1f}°, SGD {sgd['tilt']:.1g}°",
              adam["tilt"] > 5 and sgd["tilt"] < 1e-3),
        Claim(f"§7 the per-coordinate division ... tilts every step (share of the approach's "
              f"{adam['reached']} Adam steps tilted by more than {TILTED:g}° from PCGrad's "
              f"direction)", f"Adam {100 * adam['tilted_share']:.1f}%, SGD "
              f"{100 * sgd['tilted_share']:.1f}%", adam["tilted_share"] == 1.0),
        Claim("§7.2 ... so Adam lands elsewhere on the Pareto set",
              f"end points {result['end_gap']:.2f} apart", result["end_gap"] > 0.1),
        Claim("§7.2 (check) the batched runs are the library's PCGrad step",
              f"PCGrad on the runs' matrices to {result['kernel_gap']:.0e} of ‖G‖; "
              f"TaskGradBuffer + PCGrad over the first {result['check_steps']} steps to "
              f"{lib:.0e}", result["kernel_gap"] < 1e-12 and lib < 1e-10),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 6.5))
    grid = torch.linspace(-1.5, 5.5, 200, dtype=torch.float64)
    xx, yy = torch.meshgrid(grid, grid, indexing="xy")
    h = BOWL_CURVATURE
    for (cx, cy), color, label in zip(BOWL_CENTERS, ("C0", "C1"), ("task 1", "task 2")):
        loss = 0.5 * (h[0] * (xx - cx) ** 2 + h[1] * (yy - cy) ** 2)
        ax.contour(xx.numpy(), yy.numpy(), loss.numpy(), levels=[1, 4, 16, 64],
                   colors=color, alpha=0.3, linewidths=0.8)
        ax.plot(cx, cy, "+", color=color, ms=10, mew=2, label=f"{label}'s minimum")
    (x1, y1), (x2, y2) = BOWL_CENTERS
    ax.plot([x1, x2], [y1, y2], "k-", lw=3, alpha=0.3, label="Pareto set")
    for key, label, color in (("sgd", "PCGrad + SGD", "C2"), ("adam", "PCGrad + Adam", "C3")):
        run = result[key]
        ax.plot(run["x"], run["y"], ".-", color=color, ms=2, lw=1.2,
                label=f"{label} (median tilt {run['tilt']:.0f}°)")
        ax.plot(*run["end"], "o", color=color, ms=8, label=f"{label}: end")
    ax.plot(*START, "ks", ms=8, label=f"start {START}")
    ax.set_aspect("equal")
    ax.set_xlim(-1.5, 5.5)
    ax.set_ylim(-1.5, 5.5)
    ax.set_xlabel("weight 1 (10× steeper)")
    ax.set_ylabel("weight 2")
    ax.set_title(TITLE, fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    save_figure(fig, path)
