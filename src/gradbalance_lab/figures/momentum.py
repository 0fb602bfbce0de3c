"""§6.1 Momentum after a change of direction.

Setting: one weight vector ``w ∈ R²`` with the linear loss ``dₜ·w``, so the gradient is
``dₜ``: ``e₁`` for a long warm-up (the momentum reaches its steady state), then ``e₂`` (a
90° turn), written into ``.grad``, then ``torch.optim.SGD(momentum=β)`` or
``torch.optim.Adam`` (defaults). The same runs through :class:`~gradbalance.TaskGradBuffer`
with the ``Sum`` balancer give the same steps (checked over 130 steps for β = 0.9 and Adam).

Closed form (heavy ball, ``m ← β m + g``): ``n`` steps after the turn the step is
``βⁿ e₁ + (1 − βⁿ) e₂`` up to a common factor, so it has turned 45° once ``βⁿ ≤ ½``:
``n = ⌈ln ½ / ln β⌉`` = 1, 7, 69 for β = 0.5, 0.9, 0.99. The memory (all steps an impulse
gradient causes, over the first) is ``1/(1 − β)`` = 2, 10, 100; at β = 0 (plain SGD) it is
1 and the first step after the turn is the new gradient.

Adam (1000 warm-up steps): a coordinate whose gradient had been 0 has ``v = 0``; one step
after the turn its bias-corrected step is ``m̂₂/√v̂₂ = 0.1/√(0.001/0.632) ≈ 2.5`` against
``≈ 0.9`` on the old coordinate: a 70° turn in 1 step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, angle_deg, pyplot, save_figure

NAME = "momentum"
TITLE = "§6.1 Momentum after a 90° turn"
BETAS = (0.5, 0.9, 0.99)


def _linear_run(make_opt: Any, directions: list[torch.Tensor],
                library: bool = False) -> list[torch.Tensor]:
    """Feed the gradients ``directions`` one per step; return each step's ``Δw``.

    ``library``: through ``TaskGradBuffer`` + ``Sum``; otherwise ``.grad`` is set to the
    direction directly (the same gradient: checked in :func:`compute`)."""
    w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    opt = make_opt([w])
    buf = TaskGradBuffer([w], num_tasks=1)
    balancer = get_balancer("sum")
    deltas = []
    for d in directions:
        before = w.detach().clone()
        if library:
            buf.backward(torch.stack([(d * w).sum()]))
            buf.apply_(balancer)
        else:
            w.grad = d.clone()
        opt.step()
        opt.zero_grad(set_to_none=True)
        deltas.append(w.detach() - before)
    return deltas


def _turn(make_opt: Any, warm: int, after: int) -> list[float]:
    """Angle (degrees) of each step after the turn, measured from the old direction ``e₁``."""
    e1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    e2 = torch.tensor([0.0, 1.0], dtype=torch.float64)
    deltas = _linear_run(make_opt, [e1] * warm + [e2] * after)
    return [angle_deg(-d, e1) for d in deltas[warm:]]


def _steps_to(angles: list[float], threshold: float = 45.0) -> int:
    for n, a in enumerate(angles, start=1):
        if a >= threshold:
            return n
    return -1


def compute(quick: bool = False) -> dict[str, Any]:
    """Steps to turn 45° and memory span per β; Adam's steps to turn 45°."""
    result: dict[str, Any] = {"beta": list(BETAS), "angles": {}, "steps_45": {}, "memory": {}}
    for beta in BETAS:
        warm = int(10 / (1 - beta))  # βʷᵃʳᵐ < 5e-5: the steady state
        after = int(3 / (1 - beta))

        def sgd(params: list[torch.Tensor], beta: float = beta) -> torch.optim.Optimizer:
            return torch.optim.SGD(params, lr=1.0, momentum=beta)

        angles = _turn(sgd, warm, after)
        result["angles"][beta] = angles
        result["steps_45"][beta] = _steps_to(angles)
        e1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
        zero = torch.zeros(2, dtype=torch.float64)
        impulse = _linear_run(sgd, [e1] + [zero] * int(20 / (1 - beta)))
        result["memory"][beta] = float(sum(-d[0] for d in impulse) / -impulse[0][0])

    def plain(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1.0, momentum=0.0)

    e1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    impulse = _linear_run(plain, [e1] + [torch.zeros(2, dtype=torch.float64)] * 20)
    result["memory_0"] = float(sum(-d[0] for d in impulse) / -impulse[0][0])
    result["angles_0"] = _turn(plain, 10, 3)

    def adam(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params)

    adam_angles = _turn(adam, 1000, 30)
    result["adam_angles"] = adam_angles
    result["adam_steps_45"] = _steps_to(adam_angles)
    result["adam_first_angle"] = adam_angles[0]
    result["closed_form_steps_45"] = {b: math.ceil(math.log(0.5) / math.log(b)) for b in BETAS}
    e1 = torch.tensor([1.0, 0.0], dtype=torch.float64)
    e2 = torch.tensor([0.0, 1.0], dtype=torch.float64)
    gap = 0.0
    for make in (lambda p: torch.optim.SGD(p, lr=1.0, momentum=0.9), adam):
        steps = [e1] * 100 + [e2] * 30
        gap = max(gap, max(float((a - b).abs().max()) for a, b in zip(
            _linear_run(make, steps, library=True), _linear_run(make, steps))))
    result["library_gap"] = gap
    return result


def claims(result: dict[str, Any]) -> list[Claim]:
    n = result["steps_45"]
    mem = result["memory"]
    spans = ", ".join(f"{mem[b]:.2f}" for b in BETAS)
    return [
        Claim("§6 β₁ = 0.9 takes 7 steps to turn 45° after a 90° turn",
              f"{n[0.9]} steps (β = 0.5: {n[0.5]}, 0.99: {n[0.99]})", n[0.9] == 7),
        Claim("§6.1 the memory spans about 2, 10 and 100 steps at β = 0.5, 0.9, 0.99",
              f"{spans} steps", all(abs(mem[b] * (1 - b) - 1) < 0.01 for b in BETAS)),
        Claim("§6.1 at β₁ = 0 the momentum keeps only this step (closed form: memory 1, the "
              "first step after the turn is the new gradient, 90°)",
              f"memory {result['memory_0']:.6g} step; first step after the turn at "
              f"{result['angles_0'][0]:.6g}°",
              result["memory_0"] == 1.0 and abs(result["angles_0"][0] - 90.0) < 1e-9),
        Claim("§6 Adam's step can turn 45° in 1 step onto a coordinate whose gradient was small",
              f"{result['adam_steps_45']} step (first step at {result['adam_first_angle']:.1f}°)",
              result["adam_steps_45"] == 1),
        Claim("§6.1 (check) the runs' step is the library's (TaskGradBuffer + Sum)",
              f"130-step SGD (β = 0.9) and Adam runs through the library against the same runs "
              f"with the gradient written directly: steps to {result['library_gap']:.0e}",
              result["library_gap"] < 1e-12),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for beta in BETAS:
        angles = result["angles"][beta][:80]
        ax.plot(range(1, len(angles) + 1), angles, label=f"SGD momentum β = {beta}")
    adam = result["adam_angles"][:80]
    ax.plot(range(1, len(adam) + 1), adam, "k--", label="Adam (defaults)")
    ax.axhline(45, color="grey", lw=0.8, label="45°: half-way to the new direction")
    ax.axvline(result["steps_45"][0.9], color="C1", lw=0.8, ls=":",
               label=f"β = 0.9 passes 45° at step {result['steps_45'][0.9]}")
    ax.set_xlabel("steps after the 90° turn")
    ax.set_ylabel("angle of the step from the old direction (°)")
    ax.set_title(TITLE)
    ax.legend(fontsize=8, loc="upper right")
    save_figure(fig, path)
