"""Clip tutorial, Common mistakes: with a GradScaler, unscale first, then clip, then step.

Setting: a 3-task model (MLP trunk 8→16→16, linear heads, float32, seeded), batch 32, the
library's step (:class:`~gradbalance.TaskGradBuffer` given the scaler, ``Sum`` balancer), SGD
(lr 0.1) and an enabled ``torch.amp.GradScaler("cpu", init_scale=2**16)`` (checked:
``is_enabled()``). Global clipping at τ = 1 in two orders:

* right: ``scaler.unscale_(opt)``, ``clip_grad_norm_(τ)``, ``scaler.step(opt)``;
* wrong: ``clip_grad_norm_(τ)`` on the scaled gradients, then ``scaler.step(opt)`` (which
  unscales).

Both are compared with the same step without a scaler. The update is the ``.grad`` the
optimizer applied (after ``scaler.step``, ``.grad`` holds the unscaled gradient; SGD moves
the weights by lr times it). Closed form: with true norm n > τ the right order applies
``g·τ/(n + ε)``, the wrong one ``g·τ/(s·n + ε)``: s = 65536 times shorter (the threshold
acts as τ/s), up to ε/n and float32 rounding. The library's per-task clip
(``apply_(clip=TaskClip(0.3), scaler=...)``, below every task's norm) runs on the unscaled
rows: checked against the same clip without a scaler.

The plot sweeps the loss by factors 1e-7 … 10 (true norms about 1e-7 … 10): the update norm in
both orders.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.clip import TaskClip
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "clip_amp"
TITLE = "Clip tutorial, Common mistakes: the mixed-precision order (unscale, clip, step)"
TAU = 1.0
TASK_TAU = 0.3  # below every task's norm (0.39 … 0.44): the per-task clip acts on each row
SCALE = 2.0**16
EPS = 1e-6
F32 = 2.0**-24


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step has set."""
    assert p.grad is not None
    return p.grad


def _scaler() -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    if not scaler.is_enabled():
        raise RuntimeError("torch.amp.GradScaler('cpu') is disabled in this torch build")
    return scaler


def one_step(order: str, factor: float = 1.0, task_clip: bool = False) -> dict[str, Any]:
    """One step; ``order`` is "right", "wrong" or "plain" (no scaler). Returns the pre-clip
    norm, the applied update (``.grad`` after the step) and the weights' change."""
    torch.manual_seed(0)
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, 3))
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 3, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = None if order == "plain" else _scaler()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    before = [p.detach().clone() for p in model.parameters()]
    buf.backward(regression_losses(model(x), y) * factor, scaler=scaler)
    stats = buf.apply_(get_balancer("sum"), scaler=scaler,
                       clip=TaskClip(TASK_TAU) if task_clip else None)
    if order == "right":
        assert scaler is not None
        scaler.unscale_(opt)
    pre = float(torch.nn.utils.clip_grad_norm_(model.parameters(), TAU))
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    update = torch.cat([_grad(p).reshape(-1) for p in model.parameters()])
    moved = torch.cat([(b - p.detach()).reshape(-1) for b, p in zip(before, model.parameters())])
    return {"pre": pre, "update": update, "moved": moved,
            "task_pre": None if stats.pre_clip_norms is None else stats.pre_clip_norms.tolist(),
            "enabled": scaler is not None and scaler.is_enabled()}


def compute(quick: bool = False) -> dict[str, Any]:
    plain, right, wrong = (one_step(o) for o in ("plain", "right", "wrong"))
    tc_plain, tc_right = one_step("plain", task_clip=True), one_step("right", task_clip=True)
    factors = torch.logspace(-7, 1, 5 if quick else 17).tolist()
    sweep = {"factor": factors, "true": [], "right": [], "wrong": []}
    for f in factors:
        r, w = one_step("right", f), one_step("wrong", f)
        sweep["true"].append(r["pre"])
        sweep["right"].append(float(r["update"].norm()))
        sweep["wrong"].append(float(w["update"].norm()))
    n = plain["pre"]
    return {
        "enabled": right["enabled"], "scale": SCALE, "tau": TAU, "true_norm": n,
        "pre_right": right["pre"], "pre_wrong": wrong["pre"],
        "right_gap": float((right["update"] - plain["update"]).norm() / plain["update"].norm()),
        "right_len": float(right["update"].norm()), "wrong_len": float(wrong["update"].norm()),
        "plain_len": float(plain["update"].norm()),
        "moved_ratio": float(right["moved"].norm() / wrong["moved"].norm()),
        "task_pre_plain": tc_plain["task_pre"], "task_pre_right": tc_right["task_pre"],
        "task_gap": float((tc_right["update"] - tc_plain["update"]).norm()
                          / tc_plain["update"].norm()),
        "sweep": sweep,
    }


def claims(result: dict[str, Any]) -> list[Claim]:
    s, n, tau = result["scale"], result["true_norm"], result["tau"]
    off = result["right_len"] / result["wrong_len"]
    # closed form (s·n + ε)/(n + ε) = s·(1 − ε(1 − 1/s)/(n + ε)); float32: a few roundings
    expected = (s * n + EPS) / (n + EPS)
    tol = expected * 8 * F32
    return [
        Claim("§Common mistakes: with GradScaler, gradients are scaled up",
              f"GradScaler('cpu') enabled: {result['enabled']}; clip_grad_norm_ before "
              f"unscale_ returns {result['pre_wrong']:.7g} = {result['pre_wrong'] / n:.7g} × "
              f"the true norm {n:.7g}",
              result["enabled"] and abs(result["pre_wrong"] / n - s) <= s * 4 * F32),
        Claim("§Common mistakes: clip them un-scaled — scaler.unscale_(optimizer) first, then "
              "clip, then scaler.step",
              f"pre-clip norm {result['pre_right']:.7g} (no scaler: {n:.7g}); update length "
              f"{result['right_len']:.7g} = τ; differs from the step without a scaler by "
              f"{result['right_gap']:.1e} (relative)",
              abs(result["pre_right"] - n) <= n * 4 * F32 and result["right_gap"] <= 8 * F32
              and abs(result["right_len"] - tau) <= tau * (EPS / n + 8 * F32)),
        Claim("§Common mistakes: clipping scaled gradients applies a meaningless threshold",
              f"clipped before unscale_, the update is {off:.7g}× shorter (closed form "
              f"{expected:.7g}; weights moved {result['moved_ratio']:.4g}× less): the limit "
              f"acts as τ/s = {tau / s:.3g}",
              abs(off - expected) <= tol),
        Claim("§Common mistakes: the library's per-task clip (apply_(clip=TaskClip(0.3), "
              "scaler=...)) sees un-scaled rows",
              "per-task pre-clip norms with the scaler "
              + ", ".join(f"{v:.6g}" for v in result["task_pre_right"]) + " (without: "
              + ", ".join(f"{v:.6g}" for v in result["task_pre_plain"])
              + f"); .grad after unscale_ differs by {result['task_gap']:.1e}",
              result["task_gap"] <= 8 * F32 and all(
                  abs(a - b) <= b * 4 * F32
                  for a, b in zip(result["task_pre_right"], result["task_pre_plain"]))),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sw = result["sweep"]
    ax.plot(sw["true"], sw["true"], color="lightgrey", ls=":", label="no clipping")
    ax.plot(sw["true"], sw["right"], "o-", color="C0",
            label="unscale_, then clip (right): capped at τ")
    ax.plot(sw["true"], sw["wrong"], "s--", color="C3",
            label="clip the scaled gradient (wrong): capped at τ/s")
    ax.axhline(result["tau"], color="C0", lw=0.8, ls=":")
    ax.axhline(result["tau"] / result["scale"], color="C3", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("true gradient norm (unscaled)")
    ax.set_ylabel("norm of the applied update (.grad after scaler.step)")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(f"GradScaler('cpu'), s = {result['scale']:.0f}, τ = {result['tau']:g}",
                 fontsize=10)
    fig.suptitle(TITLE, fontsize=9)
    save_figure(fig, path)
