"""§7.1 Steady and sudden changes of gradient scale under Adam.

Setting: weights ``w ∈ R²`` and two linear task losses ``L₁ = a·(g₁·w)``, ``L₂ = g₂·w``
with ``g₁ = (3, 1)``, ``g₂ = (−1, 2)``, combined by the ``Sum`` balancer and stepped by
``torch.optim.Adam()`` at PyTorch's defaults (lr 1e-3, betas (0.9, 0.999), eps 1e-8).
``a = 1`` for 2000 steps (so that the bias correction of ``v`` has faded), then task 1's
gradient triples (``a = 3``) for 6000 steps (2000 with ``--quick``). The angle of each
step ``−Δw`` is measured from the first weight's axis. The long runs write the summed
gradient into ``.grad`` directly; a 300-step run through :class:`~gradbalance.TaskGradBuffer`
with ``Sum`` (the change at step 150) checks that this is the library's step.

Closed form: Adam's bias-corrected step for a constant gradient ``g`` is ``g/|g|`` per
coordinate, so before the change the step points at 45°. After it, ``m`` follows the new sum
``(8, 5)`` within ~10 steps while ``√v`` stays near ``(2, 3)`` for ~1000, so the step turns
toward ``(8/2, 5/3)`` (22.6°, the furthest it can go), then back to 45° as ``v`` catches up.
SGD, for contrast, turns from 56.3° (direction of ``(2, 3)``) to 32.0° (``(8, 5)``) and stays.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, save_figure

NAME = "adam_turn"
TITLE = "§7.1 Adam after task 1's gradient triples"
G1 = (3.0, 1.0)
G2 = (-1.0, 2.0)
BEFORE = 2000


def _angles(make_opt: Any, steps_after: int, before_steps: int = BEFORE,
            library: bool = False) -> list[float]:
    """The angle of each step. ``library``: through ``TaskGradBuffer`` + ``Sum``; otherwise
    the sum of the two (linear) task gradients is written into ``.grad`` directly."""
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    g = torch.tensor([G1, G2], dtype=torch.float64)
    opt = make_opt([w])
    buf = TaskGradBuffer([w], num_tasks=2)
    balancer = get_balancer("sum")
    angles = []
    scales = (torch.tensor([1.0, 1.0], dtype=torch.float64),
              torch.tensor([3.0, 1.0], dtype=torch.float64))
    for t in range(before_steps + steps_after):
        scale = scales[t >= before_steps]
        before = w.detach().clone()
        if library:
            buf.backward(scale * (g @ w))
            buf.apply_(balancer)
        else:
            w.grad = scale[0] * g[0] + scale[1] * g[1]
        opt.step()
        opt.zero_grad(set_to_none=True)
        d = before - w.detach()
        angles.append(math.degrees(math.atan2(float(d[1]), float(d[0]))))
    return angles


def compute(quick: bool = False) -> dict[str, Any]:
    after = 2000 if quick else 6000
    adam = _angles(lambda p: torch.optim.Adam(p), after)
    sgd = _angles(lambda p: torch.optim.SGD(p, lr=1e-3), 50)
    check = max(abs(a - b) for a, b in zip(
        _angles(lambda p: torch.optim.Adam(p), 150, 150, library=True),
        _angles(lambda p: torch.optim.Adam(p), 150, 150)))
    post = adam[BEFORE:]
    low = min(range(len(post)), key=post.__getitem__)
    return {
        "adam": adam, "sgd": sgd, "before": adam[BEFORE - 1], "lowest": post[low],
        "lowest_step": low + 1, "end": post[-1], "after_steps": after,
        "bound": math.degrees(math.atan2(5 / 3, 8 / 2)),
        "sgd_before": sgd[BEFORE - 1], "sgd_end": sgd[-1], "library_gap": check,
    }


def claims(result: dict[str, Any]) -> list[Claim]:
    turn = result["before"] - result["lowest"]
    back = abs(result["end"] - result["before"])
    return [
        Claim("§7.1 when task 1's gradient triples, Adam's step turns with the new mix",
              f"{result['before']:.1f}° → {result['lowest']:.1f}° after "
              f"{result['lowest_step']} steps (a {turn:.1f}° turn; closed-form limit "
              f"{result['bound']:.1f}°)",
              turn > 5 and result["lowest"] >= result["bound"] - 1e-6),
        Claim("§7.1 ... then turns back as each coordinate's scale catches up",
              f"{result['end']:.1f}° after {result['after_steps']} steps "
              f"({back:.1f}° from where it started)", back < 2.0),
        Claim("§7.1 SGD for contrast: turns to the new gradient and stays",
              f"{result['sgd_before']:.1f}° → {result['sgd_end']:.1f}°",
              abs(result["sgd_end"] - math.degrees(math.atan2(5, 8))) < 1e-6),
        Claim("§7.1 (check) the runs' step is the library's (TaskGradBuffer + Sum)",
              f"a 300-step Adam run (change at step 150) through the library against the same "
              f"run with the summed gradient written directly: angles to "
              f"{result['library_gap']:.0e}°", result["library_gap"] < 1e-9),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label, style in (("adam", "Adam (defaults)", "-"), ("sgd", "SGD", "--")):
        series = result[key][BEFORE - 20:]
        ax.plot([t - 19 for t in range(len(series))], series, style, label=label)
    ax.axvline(0, color="grey", lw=0.8)
    ax.axhline(result["bound"], color="C0", ls=":", lw=0.8,
               label=f"closed-form limit {result['bound']:.1f}°: m at (8, 5), √v at (2, 3)")
    ax.set_xscale("symlog", linthresh=10, linscale=1.5)
    end = result["after_steps"]  # the last tick; fixed ones within 2× of it would collide
    ticks = [t for t in (-10, 0, 10, 30, 100, 300, 1000) if t < end / 2] + [end]
    ax.set_xticks(ticks, [str(t) for t in ticks], fontsize=8)
    ax.set_xticks([], minor=True)
    low = result["lowest_step"]
    ax.plot([low], [result["lowest"]], "v", color="C0",
            label=f"furthest turn: {result['lowest']:.1f}° at step {low}")
    ax.set_xlabel("steps after task 1's gradient triples (linear to ±10, log beyond)")
    ax.set_ylabel("angle of the step (°)")
    ax.set_title(TITLE)
    ax.legend(fontsize=8)
    save_figure(fig, path)
