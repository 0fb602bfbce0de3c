"""§8.1 PCGrad with heavy-ball momentum on two strongly convex losses.

Setting: the two-bowl example of :mod:`._common` (strongly convex, exact gradients), eight
starts on a circle of radius 4 around (1.5, 1.5) (four with ``--quick``); the library's
``PCGrad``, then ``torch.optim.SGD(lr=0.01, momentum=0.9)`` (PyTorch's heavy ball) for 3,000
steps (500 with ``--quick``); the same starts with ``momentum=0`` are the contrast. On the
quadratic the heavy ball contracts by ``√0.9 ≈ 0.95`` per step on both axes, so the step size
is tuned in the sense of the theorem. All starts run at once with the batched two-task PCGrad
of :mod:`._common`, checked against the library (``PCGrad`` on the runs' matrices, and
:class:`~gradbalance.TaskGradBuffer` with ``PCGrad`` over the first 200 steps of two starts).
The run without momentum stops once no weight moves (plain SGD: a fixed point).

Theorem (the PCGrad paper, Theorem 4, Appendix A.4): the iterates reach either the optimum of
``L₁ + L₂`` or a point where the two gradients point exactly opposite. At each end point the
exact gradients give ``‖g₁ + g₂‖`` and ``1 + cos(g₁, g₂)``; the claim holds when either is 0
(to 1e-6).

Momentum and the component PCGrad removes: on a step where the task gradients conflict
(``g₁·g₂ < 0``) PCGrad removes the conflicting components, so the direction it hands over has
a non-negative inner product with both task gradients. The heavy ball steps along
``m ← 0.9 m + g``, the sum of past handed-over directions: counted are the steps whose
actual step ``−Δw`` has a negative inner product with a task gradient (it goes uphill for that
task, to first order), against the same count for the handed-over direction; counted are
the steps that move (``‖Δw‖ > 1e-9``) with a handed-over direction above rounding
(``‖g‖ > 1e-6 ‖G‖``: at the Pareto set it is the rounding noise of two opposed gradients).
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
    bowl_gradients,
    kernel_gap,
    pyplot,
    require_balancer,
    save_figure,
    train_bowls,
)

NAME = "pcgrad_momentum"
TITLE = "§8.1 PCGrad + heavy-ball momentum (two strongly convex bowls)"
TOL = 1e-6
LR = 0.01
BETA = 0.9
CHECK_STEPS = 200
MOVING = 1e-9


def _starts(n: int) -> torch.Tensor:
    phi = [2 * math.pi * (i + 0.5) / n for i in range(n)]
    return torch.tensor([[round(1.5 + 4 * math.cos(p), 12) + 0.0,
                          round(1.5 + 4 * math.sin(p), 12) + 0.0] for p in phi],
                        dtype=torch.float64)


def _uphill(direction: torch.Tensor, matrices: torch.Tensor) -> torch.Tensor:
    """``[n, B]`` bool: ``direction`` ``[n, B, 2]`` has a negative inner product with a task
    gradient (``matrices`` ``[n, B, 2, 2]``), beyond rounding."""
    dots = (matrices * direction.unsqueeze(-2)).sum(-1)
    scale = matrices.norm(dim=-1) * direction.norm(dim=-1, keepdim=True)
    out: torch.Tensor = (dots < -1e-9 * scale).any(dim=-1)
    return out


def _min_cos(direction: torch.Tensor, matrices: torch.Tensor, counted: torch.Tensor) -> list[float]:
    """Run 0's ``min_k cos(direction, g_k)`` per step (NaN where the step is not counted)."""
    d, g = direction[:, 0], matrices[:, 0]
    cos = (g * d.unsqueeze(-2)).sum(-1) / (g.norm(dim=-1) * d.norm(dim=-1, keepdim=True))
    low = cos.min(dim=-1).values
    return torch.where(counted[:, 0], low, torch.nan).tolist()


def _conflicts(run: dict[str, torch.Tensor]) -> dict[str, Any]:
    path, mats, handed = run["path"], run["matrices"], run["handed"]
    step = path[:-1] - path[1:]
    # Counted: steps that move, away from the cancellation at the Pareto set (where the
    # handed-over direction is rounding noise of the opposed gradients).
    moving = (step.norm(dim=-1) > MOVING) & (handed.norm(dim=-1) > 1e-6 * mats.norm(dim=(-2, -1)))
    g1, g2 = mats[..., 0, :], mats[..., 1, :]
    conflict = ((g1 * g2).sum(-1) < 0) & moving
    step_up = _uphill(step, mats) & moving
    handed_up = _uphill(handed, mats) & moving
    return {
        "moving": int(moving.sum()), "conflict": int(conflict.sum()),
        "step_uphill": int(step_up.sum()), "handed_uphill": int(handed_up.sum()),
        "step_uphill_on_conflict": int((step_up & conflict).sum()),
        "step_cos": _min_cos(step, mats, moving), "handed_cos": _min_cos(handed, mats, moving),
        "conflict_run0": conflict[:, 0].tolist(),
    }


def compute(quick: bool = False) -> dict[str, Any]:
    n = 4 if quick else 8
    steps = 500 if quick else 3000
    check = 100 if quick else CHECK_STEPS
    balancer = require_balancer("pcgrad")
    starts = _starts(n)
    heavy = train_bowls(starts, "pcgrad",
                        lambda p: torch.optim.SGD(p, lr=LR, momentum=BETA), steps)
    plain = train_bowls(starts, "pcgrad", lambda p: torch.optim.SGD(p, lr=LR), steps,
                        until_still=True)
    ends = heavy["path"][-1]
    g = bowl_gradients(ends)
    cos = (g[:, 0] * g[:, 1]).sum(-1) / (g[:, 0].norm(dim=-1) * g[:, 1].norm(dim=-1))
    runs = [{"start": starts[i].tolist(), "x": heavy["path"][:, i, 0].tolist(),
             "y": heavy["path"][:, i, 1].tolist(), "end": ends[i].tolist(),
             "sum_norm": float(g[i].sum(dim=0).norm()), "one_plus_cos": float(1 + cos[i])}
            for i in range(n)]
    lib_gap = 0.0
    for i in range(2):
        library = TwoBowls(start=tuple(starts[i].tolist())).train(
            balancer, lambda p: torch.optim.SGD(p, lr=LR, momentum=BETA), check)
        lib_path = torch.tensor([library["x"], library["y"]], dtype=torch.float64).T
        lib_gap = max(lib_gap, float((lib_path - heavy["path"][1:check + 1, i]).abs().max()))
    return {"runs": runs, "steps": steps, "starts": n, "heavy": _conflicts(heavy),
            "plain": _conflicts(plain), "check_steps": check, "library_gap": lib_gap,
            "kernel_gap": kernel_gap("pcgrad", heavy["matrices"])}


def claims(result: dict[str, Any]) -> list[Claim]:
    runs = result["runs"]
    worst = max(min(r["sum_norm"], r["one_plus_cos"]) for r in runs)
    at_opt = sum(r["sum_norm"] < TOL for r in runs)
    opposed = sum(r["one_plus_cos"] < TOL for r in runs)
    heavy, plain = result["heavy"], result["plain"]
    return [
        Claim("§8.1 PCGrad with heavy-ball momentum reaches the optimum or a point where the two "
              "gradients point exactly opposite (Theorem 4)",
              f"{len(runs)} starts, {result['steps']} steps: {at_opt} at the optimum of the "
              f"sum, {opposed} with opposed gradients; worst min(‖g₁+g₂‖, 1+cos) = {worst:.1e}",
              worst < TOL),
        Claim("§8.1 momentum carries the past into every step: PCGrad's direction never goes "
              "uphill for a task, the heavy ball's step does",
              f"steps that move: {heavy['moving']}; gradients conflict on {heavy['conflict']}; "
              f"handed-over direction uphill for a task on {heavy['handed_uphill']}; "
              f"momentum step uphill on {heavy['step_uphill']} ({heavy['step_uphill_on_conflict']}"
              f" of them conflicting steps); without momentum: {plain['step_uphill']} of "
              f"{plain['moving']}",
              heavy["handed_uphill"] == 0 and heavy["step_uphill"] > 0
              and plain["step_uphill"] == 0),
        Claim("§8.1 (check) the batched runs are the library's PCGrad step",
              f"PCGrad on the runs' matrices to {result['kernel_gap']:.0e} of ‖G‖; "
              f"TaskGradBuffer + PCGrad + SGD(momentum) over the first {result['check_steps']} "
              f"steps of two starts to {result['library_gap']:.0e}",
              result["kernel_gap"] < 1e-12 and result["library_gap"] < 1e-10),
    ]


def _coord(value: float) -> str:
    """A start coordinate to one decimal, without a negative zero."""
    return f"{value:.1f}".replace("-0.0", "0.0") if abs(value) < 0.05 else f"{value:.1f}"


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    runs = result["runs"]
    cols = 4
    rows = math.ceil(len(runs) / cols)
    fig = plt.figure(figsize=(12, 3.3 * rows + 3.4))
    grid = fig.add_gridspec(rows + 1, cols, height_ratios=[3] * rows + [2.6])
    (x1, y1), (x2, y2) = BOWL_CENTERS
    for i, run in enumerate(runs):
        ax = fig.add_subplot(grid[i // cols, i % cols])
        ax.plot([x1, x2], [y1, y2], "k-", lw=3, alpha=0.3,
                label="Pareto set (gradients opposed)")
        ax.plot(run["x"], run["y"], color="C0", lw=0.8, label="heavy-ball path")
        ax.plot(*run["start"], "s", color="C2", label="start")
        ax.plot(*run["end"], "o", color="C3", label="end")
        ax.set_xlim(-3, 6)
        ax.set_ylim(-3, 6)
        ax.set_aspect("equal")
        ax.set_xlabel("weight 1", fontsize=8)
        ax.set_ylabel("weight 2", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_title(f"start ({_coord(run['start'][0])}, {_coord(run['start'][1])})",
                     fontsize=9)
        if i == 0:
            fig.legend(*ax.get_legend_handles_labels(), loc="upper center", ncol=4,
                       fontsize=9, bbox_to_anchor=(0.5, 0.955), frameon=False)
    ax = fig.add_subplot(grid[rows, :])
    heavy, plain = result["heavy"], result["plain"]
    moving = [i for i, c in enumerate(heavy["step_cos"]) if c == c]  # not NaN
    shown = min(len(heavy["step_cos"]), (moving[-1] + 2) if moving else 50)
    xs = list(range(1, shown + 1))
    ax.plot(xs, heavy["step_cos"][:shown], color="C3", lw=1,
            label="heavy-ball step −Δw (momentum 0.9)")
    ax.plot(xs, heavy["handed_cos"][:shown], color="C0", lw=1,
            label="direction PCGrad handed over")
    ax.plot(xs[:len(plain["step_cos"])], plain["step_cos"][:shown], ":", color="C2", lw=1,
            label="SGD step without momentum (its own run)")
    ax.axhline(0, color="k", lw=0.8)
    ax.text(xs[-1], -0.05, "below 0: uphill for a task", ha="right", va="top", fontsize=8)
    ax.set_xlabel(f"step (start ({_coord(runs[0]['start'][0])}, {_coord(runs[0]['start'][1])}), "
                  f"while it moves)")
    ax.set_ylabel("min over tasks of cos(·, gₖ)")
    ax.set_ylim(-1.05, 1.05)
    ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(TITLE, y=0.995)
    save_figure(fig, path, rect=(0, 0, 1, 0.93))
