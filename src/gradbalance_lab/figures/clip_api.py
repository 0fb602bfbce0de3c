"""Clip tutorial, Definitions and Common mistakes: ``norm_type``, ``foreach``, only ``.grad``.

Setting: a 3-task model (MLP trunk 8→16→16, linear heads, float32, seeded), batch 32; the
library's step (:class:`~gradbalance.TaskGradBuffer`, ``Mean`` balancer) writes ``.grad``,
which is then multiplied by 100 so that every clip below is active.

* ``norm_type=inf``: ``clip_grad_norm_(params, 0.01, norm_type=inf)`` returns the largest
  ``|gᵢ|`` over all parameters (checked against the maximum taken here) and leaves the
  largest entry at 0.01 (the ε of the formula: 0.01·ε/max|g| below it, plus float32
  rounding); the library's ``TaskClip(0.01, norm_type=inf)`` on the rows of ``G`` leaves every
  row's largest entry at 0.01 the same way.
* the global norm: ``clip_grad_norm_(params, 1)``'s return against the norm of all the
  gradient entries concatenated and the norm of the vector of per-tensor norms (float64,
  computed here), and the factor each tensor was scaled by (one factor, ``1/(‖g‖ + ε)``, for
  all of them, within float32 rounding);
* ``foreach``: the same clip at ``max_norm=1`` with ``foreach=True`` and ``foreach=False`` (torch
  2.x's grouped kernels against the per-tensor loop): returned norms and every ``.grad`` are
  compared bit for bit.
* only ``.grad``: ``clip_grad_norm_``, ``clip_grad_value_``, the library's ``AutoClip`` and
  ``AGC``, and ``TaskGradBuffer.apply_(clip=TaskClip(...))``: every weight is compared bit for
  bit before and after (and ``.grad`` is checked to have changed).

The plot: 300 random 2-D gradients (float64, sizes up to 3) clipped at 1 with ``norm_type``
2 and inf; those the clip shortened land on the circle and on the square.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.clip import AGC, AutoClip, TaskClip
from gradbalance.step import TaskGradBuffer
from gradbalance.taskgrads import task_gradients
from gradbalance_lab.figures._common import Claim, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "clip_api"
TITLE = "Clip tutorial, Definitions: norm_type=inf and foreach; Common mistakes: only .grad"
INF = float("inf")
EPS = 1e-6
F32 = 2.0**-24  # float32 unit roundoff


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step has set."""
    assert p.grad is not None
    return p.grad


def _model(seed: int = 0) -> tuple[MultiTaskModel, torch.Tensor]:
    """The model with ``.grad`` written by the library's step, times 100; returns (model, G)."""
    torch.manual_seed(seed)
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, 3))
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 3, generator=gen) * 3
    losses = regression_losses(model(x), y)
    matrix = task_gradients(list(losses), model.shared_parameters(), retain_graph=True)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    buf.backward(losses)
    buf.apply_(get_balancer("mean"))
    for p in model.parameters():
        _grad(p).mul_(100.0)
    return model, matrix.detach() * 100.0


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [_grad(p).detach().clone() for p in model.parameters()]


def _norm_inf() -> dict[str, Any]:
    model, matrix = _model()
    largest = float(torch.cat([g.abs().reshape(-1) for g in _grads(model)]).max())
    returned = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type=INF))
    after = float(torch.cat([g.abs().reshape(-1) for g in _grads(model)]).max())
    pre = TaskClip(0.01, norm_type=INF)(matrix)
    return {"largest": largest, "returned": returned, "after": after,
            "rows_pre": pre.tolist(), "rows_after": matrix.abs().amax(dim=1).tolist()}


def _foreach() -> dict[str, Any]:
    out = {}
    for flag in (True, False):
        model, _ = _model()
        returned = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=flag)
        out[flag] = (returned, _grads(model))
    same_norm = bool(torch.equal(out[True][0], out[False][0]))
    same = all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1]))
    return {"returned": float(out[True][0]), "same_norm": same_norm, "same_grads": same,
            "tensors": len(out[True][1])}


def _global() -> dict[str, Any]:
    """``clip_grad_norm_(max_norm=1)``'s return against the norm of every gradient entry
    concatenated and the norm of the per-tensor norms (both float64, here), and the factor
    each tensor was scaled by."""
    model, _ = _model()
    before = [g.double() for g in _grads(model)]
    returned = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    per_tensor = [float(g.norm()) for g in before]
    factors = [float((a.double() * b).sum() / (b * b).sum())
               for a, b in zip(_grads(model), before) if float(b.norm()) > 0]
    return {"returned": returned, "concat": float(torch.cat([g.reshape(-1) for g in before])
                                                   .norm()),
            "of_norms": sum(n * n for n in per_tensor) ** 0.5, "largest": max(per_tensor),
            "tensors": len(per_tensor), "factors": [min(factors), max(factors)]}


def _autoclip(model: torch.nn.Module) -> None:
    """AutoClip at the median of a history holding this gradient / 64 and the gradient."""
    clip = AutoClip(percentile=50)
    for p in model.parameters():
        _grad(p).div_(64.0)  # a power of two: exact both ways
    clip(model.parameters())
    for p in model.parameters():
        _grad(p).mul_(64.0)
    clip(model.parameters())


def _grad_only() -> dict[str, dict[str, Any]]:
    clippers: dict[str, Callable[[torch.nn.Module], object]] = {
        "clip_grad_norm_": lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0),
        "clip_grad_value_": lambda m: torch.nn.utils.clip_grad_value_(m.parameters(), 0.01),
        "AutoClip": _autoclip,
        "AGC": lambda m: AGC(clip_factor=0.001)(m.parameters()),
    }
    out = {}
    for name, clip in clippers.items():
        model, _ = _model()
        weights, grads = [p.detach().clone() for p in model.parameters()], _grads(model)
        clip(model)
        out[name] = {
            "weights_same": all(torch.equal(w, p.detach())
                                for w, p in zip(weights, model.parameters())),
            "grad_changed": any(not torch.equal(g, _grad(p))
                                for g, p in zip(grads, model.parameters()))}
    # the per-task clip inside the library's step: G's rows, then .grad
    by_clip: dict[bool, list[torch.Tensor]] = {}
    for clip_rows in (None, TaskClip(max_norm=0.01)):
        torch.manual_seed(0)
        model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, 3))
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 3, generator=gen) * 3
        weights = [p.detach().clone() for p in model.parameters()]
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
        buf.backward(regression_losses(model(x), y))
        buf.apply_(get_balancer("mean"), clip=clip_rows)
        by_clip[clip_rows is None] = _grads(model)
    out["TaskClip (apply_)"] = {
        "weights_same": all(torch.equal(w, p.detach())
                            for w, p in zip(weights, model.parameters())),
        "grad_changed": any(not torch.equal(a, b) for a, b in zip(by_clip[True], by_clip[False]))}
    return out


def _cloud(n: int) -> dict[str, list[list[float]]]:
    gen = torch.Generator().manual_seed(1)
    angle = torch.rand(n, generator=gen, dtype=torch.float64) * 2 * torch.pi
    size = torch.rand(n, generator=gen, dtype=torch.float64) * 3
    raw = torch.stack([angle.cos(), angle.sin()], dim=1) * size.unsqueeze(1)
    out: dict[str, list[list[float]]] = {"raw": raw.tolist()}
    for key, p in (("l2", 2.0), ("linf", INF)):
        clipped = []
        for g in raw:
            w = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
            w.grad = g.clone()
            torch.nn.utils.clip_grad_norm_([w], 1.0, norm_type=p)
            clipped.append(w.grad.tolist())
        out[key] = clipped
    return out


def compute(quick: bool = False) -> dict[str, Any]:
    return {"inf": _norm_inf(), "foreach": _foreach(), "grad_only": _grad_only(),
            "global": _global(),
            "cloud": _cloud(60 if quick else 300)}


def claims(result: dict[str, Any]) -> list[Claim]:
    inf, fe, only = result["inf"], result["foreach"], result["grad_only"]
    # the largest entry ends at 0.01·max/(max + ε), rounded to float32 (a few units)
    tol = 0.01 * (EPS / inf["largest"] + 4 * F32)
    rows_ok = all(abs(r - 0.01) <= 0.01 * (EPS / pre + 4 * F32)
                  for r, pre in zip(inf["rows_after"], inf["rows_pre"]) if pre > 0.01)
    glob = result["global"]
    lo, hi = glob["factors"]
    expected = 1.0 / (glob["concat"] + EPS)
    return [
        Claim("§Definitions: ‖g‖₂ its global L2 norm, computed across all parameters jointly "
              "(the default in clip_grad_norm_)",
              f"{glob['tensors']} tensors: returned {glob['returned']:.7g}; norm of all entries "
              f"concatenated {glob['concat']:.7g}, of the per-tensor norms "
              f"{glob['of_norms']:.7g} (largest per-tensor norm {glob['largest']:.4g}); every "
              f"tensor scaled by {lo:.7g} … {hi:.7g} (1/(‖g‖ + ε) = {expected:.7g})",
              abs(glob["returned"] / glob["concat"] - 1) < 4 * F32
              and abs(glob["of_norms"] / glob["concat"] - 1) < 1e-12
              and abs(lo / expected - 1) < 4 * F32 and abs(hi / expected - 1) < 4 * F32
              and glob["largest"] < glob["returned"]),
        Claim("§Definitions: clip_grad_norm_ also accepts norm_type (any p-norm, including "
              "inf)",
              f"norm_type=inf returns {inf['returned']:.7g} = max|gᵢ| {inf['largest']:.7g}; "
              f"largest entry after clipping at 0.01: {inf['after']:.7g}; TaskClip(norm_type="
              f"inf) rows: " + ", ".join(f"{r:.7g}" for r in inf["rows_after"]),
              inf["returned"] == inf["largest"] and abs(inf["after"] - 0.01) <= tol
              and rows_ok),
        Claim("§Definitions: ... and foreach=True fused implementations in torch 2.x",
              f"foreach=True vs False on {fe['tensors']} tensors: returned norm "
              f"{fe['returned']:.7g} identical: {fe['same_norm']}; every .grad bitwise "
              f"identical: {fe['same_grads']}",
              fe["same_norm"] and fe["same_grads"]),
        Claim("§Common mistakes: clip_grad_norm_ touches .grad only (clamping weights is a "
              "different intervention)",
              "; ".join(f"{k}: weights bitwise unchanged {v['weights_same']}, .grad changed "
                        f"{v['grad_changed']}" for k, v in only.items()),
              all(v["weights_same"] and v["grad_changed"] for v in only.values())),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 6))
    cloud = result["cloud"]
    raw = list(zip(*cloud["raw"]))
    ax.scatter(raw[0], raw[1], s=6, color="lightgrey", label="gradient before clipping")
    for key, order, color, label in (
            ("l2", 2.0, "C0", "clipped with norm_type=2: on the circle"),
            ("linf", INF, "C3", "clipped with norm_type=inf: on the square")):
        acted = [c for r, c in zip(cloud["raw"], cloud[key])
                 if float(torch.linalg.vector_norm(torch.tensor(r), ord=order)) > 1.0]
        pts = list(zip(*acted))
        ax.scatter(pts[0], pts[1], s=8, color=color, label=label)
    ax.set_aspect("equal")
    ax.set_ylim(-3.2, 4.4)
    ax.set_xlabel("gradient, coordinate 1")
    ax.set_ylabel("gradient, coordinate 2")
    ax.legend(loc="upper center", fontsize=8)
    ax.set_title("clip_grad_norm_(max_norm=1): 2-norm vs inf-norm", fontsize=10)
    fig.suptitle(TITLE, fontsize=8)
    save_figure(fig, path)
