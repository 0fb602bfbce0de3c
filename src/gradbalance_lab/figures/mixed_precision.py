"""§11 Mixed precision: one scale s for every task, sizes divided by s, skipped steps.

Setting: a 3-task model (MLP trunk 8→16→16, linear heads, batch 16, seeded) whose forward
runs under ``torch.autocast("cpu", dtype=torch.bfloat16)``, and an enabled
``torch.amp.GradScaler("cpu", init_scale=2**16)``. The step is the library's
:class:`~gradbalance.TaskGradBuffer` given the scaler, then ``scaler.unscale_``,
``scaler.step`` and ``scaler.update``, as in the text.

Measured:

* the task gradients of the scaled losses (``task_gradients(scaler.scale(L))``), divided by
  ``s``, against the true sizes the step reports (``StepStats.task_norms``) and against the
  gradients of the unscaled losses;
* for every balancer the library registers (built with its defaults, seeded), the trunk's
  ``.grad`` after ``scaler.unscale_`` against the same step without a scaler: the angle
  between them and their length ratio;
* a step whose loss overflows (task 0's loss times inf): the scaler skips it, and the
  weights, the optimizer state and every stateful balancer's ``state_dict()`` are unchanged.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import BALANCERS, Balancer, get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance.taskgrads import task_gradients
from gradbalance_lab.figures._common import Claim, angle_deg, grad_of, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "mixed_precision"
TITLE = "§11 Mixed precision: true sizes, directions and skipped steps"
SCALE = 2.0**16


def _tolist(values: torch.Tensor | None) -> list[float]:
    if values is None:
        raise RuntimeError("the step reported no task norms")
    out: list[float] = values.tolist()
    return out


def _setup(seed: int = 0) -> tuple[MultiTaskModel, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, 3))
    gen = torch.Generator().manual_seed(seed)
    return model, torch.randn(16, 8, generator=gen), torch.randn(16, 3, generator=gen)


def _losses(model: MultiTaskModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model(x)
    return regression_losses([o.float() for o in outputs], y)


def _scaler() -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    if not scaler.is_enabled():
        raise RuntimeError("torch.amp.GradScaler('cpu') is disabled in this torch build")
    return scaler


def _build(name: str) -> Balancer | None:
    torch.manual_seed(123)
    try:
        return get_balancer(name)
    except (TypeError, ValueError):
        return None  # needs settings (e.g. Constant's weights)


def _trunk_grad(name: str, use_scaler: bool) -> torch.Tensor | None:
    balancer = _build(name)
    if balancer is None:
        return None
    model, x, y = _setup()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = _scaler() if use_scaler else None
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    torch.manual_seed(7)
    buf.backward(_losses(model, x, y), scaler=scaler)
    buf.apply_(balancer, scaler=scaler)
    if scaler is not None:
        scaler.unscale_(opt)
    return torch.cat([grad_of(p).reshape(-1) for p in model.shared_parameters()]).double()


def _equal_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                  and torch.equal(a.nan_to_num(), b.nan_to_num())))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _equal_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal_state(u, v) for u, v in zip(a, b))
    return bool(a == b)


def _snapshot(obj: Any) -> Any:
    state = obj.state_dict()

    def copy(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.detach().clone()
        if isinstance(v, dict):
            return {k: copy(u) for k, u in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(copy(u) for u in v)
        return v

    return copy(state)


def _skipped_step(name: str) -> dict[str, Any] | None:
    balancer = _build(name)
    if balancer is None:
        return None
    model, x, y = _setup()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = _scaler()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    for _ in range(2):  # two good steps give every state something to hold
        buf.backward(_losses(model, x, y), scaler=scaler)
        buf.apply_(balancer, scaler=scaler)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
    weights = [p.detach().clone() for p in model.parameters()]
    bal_state, opt_state = _snapshot(balancer), _snapshot(opt)
    s = scaler.get_scale()
    bad = _losses(model, x, y) * torch.tensor([math.inf, 1.0, 1.0])
    buf.backward(bad, scaler=scaler)
    stats = buf.apply_(balancer, scaler=scaler)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=True)
    skipped = scaler.get_scale() < s
    same_weights = all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
    return {"skipped": bool(skipped and stats.found_inf), "weights": same_weights,
            "optimizer": _equal_state(opt_state, opt.state_dict()),
            "balancer": _equal_state(bal_state, balancer.state_dict()),
            "stateful": bool(bal_state)}


def compute(quick: bool = False) -> dict[str, Any]:
    model, x, y = _setup()
    scaler = _scaler()
    losses = _losses(model, x, y)
    s = float(scaler.get_scale())
    scaled = task_gradients(scaler.scale(losses), model.shared_parameters(), retain_graph=True)
    plain = task_gradients(losses, model.shared_parameters())
    model2, x2, y2 = _setup()
    buf = TaskGradBuffer(model2.shared_parameters(), model2.head_parameters())
    buf.backward(_losses(model2, x2, y2), scaler=scaler)
    stats = buf.apply_(get_balancer("sum"), scaler=scaler)
    result: dict[str, Any] = {
        "scale": s,
        "scaled_sizes": scaled.double().norm(dim=1).tolist(),
        "true_sizes": _tolist(stats.task_norms),
        "plain_sizes": plain.double().norm(dim=1).tolist(),
        "loss_scale_reported": stats.loss_scale,
        "balancers": {},
        "skips": {},
    }
    for name in sorted(BALANCERS):
        with_scaler, without = _trunk_grad(name, True), _trunk_grad(name, False)
        if with_scaler is None or without is None:
            continue
        result["balancers"][name] = {
            "angle": angle_deg(with_scaler, without),
            "ratio": float(with_scaler.norm() / without.norm()) if without.norm() > 0 else 1.0,
        }
        result["skips"][name] = _skipped_step(name)
    return result


def claims(result: dict[str, Any]) -> list[Claim]:
    s = result["scale"]
    div = [a / s for a in result["scaled_sizes"]]
    err = max(abs(d / t - 1) for d, t in zip(div, result["true_sizes"]))
    err_plain = max(abs(p / t - 1) for p, t in zip(result["plain_sizes"], result["true_sizes"]))
    bal = result["balancers"]
    worst_angle = max(b["angle"] for b in bal.values())
    worst_ratio = max(abs(b["ratio"] - 1) for b in bal.values())
    worst_name = max(bal, key=lambda n: bal[n]["angle"])
    skips = result["skips"]
    stateful = sorted(n for n, v in skips.items() if v["stateful"])
    bad = sorted(n for n, v in skips.items()
                 if not (v["skipped"] and v["weights"] and v["optimizer"] and v["balancer"]))
    return [
        Claim("§11 true gradient sizes are the scaled sizes divided by s",
              f"s = {s:.0f}; scaled/s = " + ", ".join(f"{d:.5g}" for d in div)
              + "; reported " + ", ".join(f"{t:.5g}" for t in result["true_sizes"])
              + f" (to {err:.0e}; unscaled losses to {err_plain:.0e})",
              err < 1e-6 and err_plain < 1e-5),
        Claim("§11 every task carries the same s, so no balancer's direction changes",
              f"{len(bal)} balancers: largest angle {worst_angle:.1e}° ({worst_name}), length "
              f"ratio within {worst_ratio:.0e} of 1", worst_angle < 1e-3 and worst_ratio < 1e-5),
        Claim("§11 a skipped step leaves balancer state untouched (weights, optimizer, balancer)",
              f"{len(skips)} balancers skipped; stateful: {', '.join(stateful)}; changed: "
              f"{', '.join(bad) or 'none'}", not bad and bool(stateful)),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 6.5))
    k = range(len(result["true_sizes"]))
    s = result["scale"]
    ax1.bar([i - 0.2 for i in k], [a / s for a in result["scaled_sizes"]], 0.4,
            label="scaled size / s")
    ax1.bar([i + 0.2 for i in k], result["true_sizes"], 0.4, label="StepStats.task_norms")
    ax1.set_xticks(list(k), [f"task {i}" for i in k])
    ax1.set_ylabel("gradient norm over the trunk")
    ax1.set_title(f"true sizes (s = {s:.0f})")
    ax1.legend()
    names = sorted(result["balancers"])
    angles = [result["balancers"][n]["angle"] for n in names]
    ax2.barh(names, [a if a > 0 else 0.0 for a in angles], left=1e-12, color="C0")
    for name, a in zip(names, angles):
        if a == 0:  # a log axis has no 0: say it in words
            ax2.text(2e-12, name, "exactly 0", va="center", fontsize=7, color="C7")
    ax2.set_xscale("log")
    ax2.set_xlim(1e-12, 1)
    ax2.set_xlabel("angle between the scaled and unscaled step (°, log)")
    zero = sum(a == 0 for a in angles)
    ax2.set_title(f"angle per balancer: {zero} of {len(angles)} exactly 0, the largest "
                  f"{max(angles):.0e}° (float32 rounding)", fontsize=10)
    ax2.tick_params(axis="y", labelsize=8)
    fig.suptitle(TITLE)
    save_figure(fig, path)
