"""Clip tutorial, Common mistakes: clipping is not a NaN cure; what the library does instead.

Setting (float32): a linear model ``w`` (5 weights) with loss ``mean((x w − y)²)`` over 8
samples, one of whose inputs holds a NaN, so the loss and every gradient entry are NaN; and two
hand-set gradients ``[1, NaN, 3, 4, 5]`` and ``[1, inf, 3, 4, 5]``. Each goes through
``torch.nn.utils.clip_grad_norm_(max_norm=1)``, then again with ``error_if_nonfinite=True``.

The library's clippers on the same gradients:

* :class:`~gradbalance.clip.TaskClip` ``(max_norm=1)`` on ``G = [[30, 40], [NaN, 1]]``: the
  finite row is clipped, the NaN row left as it is; with ``error_if_nonfinite=True`` it
  raises ``NonFiniteGradientError`` and ``G`` is unchanged.
* :class:`~gradbalance.clip.AutoClip` after three healthy norms: on the NaN gradient it clips
  nothing, returns the norm and leaves its history alone; :class:`~gradbalance.clip.AGC`
  and :class:`~gradbalance.clip.PerSampleClip` raise.
* the step (:class:`~gradbalance.TaskGradBuffer`, ``Sum`` balancer) on the NaN loss: without
  a scaler ``apply_`` raises and leaves ``.grad`` unset; with an enabled
  ``torch.amp.GradScaler("cpu")`` the step is skipped (weights unchanged, scale halved).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gradbalance import NonFiniteGradientError
from gradbalance.balancers import get_balancer
from gradbalance.clip import AGC, AutoClip, PerSampleClip, TaskClip
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, save_figure

NAME = "clip_nonfinite"
TITLE = "Clip tutorial, Common mistakes: clipping is not a NaN cure"
NAN, INF = float("nan"), float("inf")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise-equal values, NaN where NaN."""
    return bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0),
                                                                  b.nan_to_num(0.0)))


def _nan_loss_problem() -> tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(5, generator=gen))
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, generator=gen)
    x[3, 2] = NAN
    return w, x, y


def _torch_clip(grad: torch.Tensor) -> dict[str, Any]:
    w = torch.nn.Parameter(torch.zeros_like(grad))
    w.grad = grad.clone()
    returned = float(torch.nn.utils.clip_grad_norm_([w], max_norm=1.0))
    after = w.grad.clone()
    w.grad = grad.clone()
    try:
        torch.nn.utils.clip_grad_norm_([w], max_norm=1.0, error_if_nonfinite=True)
        raised = ""
    except RuntimeError as error:
        raised = type(error).__name__
    return {"before": grad.tolist(), "returned": returned, "after": after.tolist(),
            "raised": raised, "after_strict": w.grad.tolist(), "untouched": _same(w.grad, grad)}


def _raises(call: Callable[[], Any]) -> str:
    try:
        call()
    except NonFiniteGradientError as error:
        return type(error).__name__
    return ""


def _library(grad: torch.Tensor) -> dict[str, Any]:
    matrix = torch.tensor([[30.0, 40.0], [NAN, 1.0]])
    pre = TaskClip(max_norm=1.0)(matrix)
    strict = torch.tensor([[30.0, 40.0], [NAN, 1.0]])
    kept = strict.clone()
    task_raised = _raises(lambda: TaskClip(max_norm=1.0, error_if_nonfinite=True)(strict))

    auto = AutoClip(percentile=50)
    w = torch.nn.Parameter(torch.zeros_like(grad))
    for scale in (1.0, 2.0, 3.0):
        w.grad = torch.tensor([0.6, 0.8, 0.0, 0.0, 0.0]) * scale
        auto([w])
    assert auto.threshold is not None
    history, threshold = len(auto.history), float(auto.threshold[0])
    w.grad = grad.clone()
    auto_returned = float(auto([w]))
    auto_after = w.grad.clone()
    auto_strict = AutoClip(percentile=50, error_if_nonfinite=True)
    w.grad = grad.clone()
    return {
        "task_rows": matrix.tolist(), "task_pre": pre.tolist(), "task_raised": task_raised,
        "task_unchanged": _same(strict, kept),
        "auto_returned": auto_returned, "auto_after": auto_after.tolist(),
        "auto_untouched": _same(auto_after, grad),
        "auto_history": (history, len(auto.history)),
        "auto_threshold": (threshold, float(auto.threshold[0])),
        "auto_raised": _raises(lambda: auto_strict([w])),
        "agc_raised": _raises(lambda: AGC(error_if_nonfinite=True)([w])),
    }


def _per_sample() -> str:
    w, x, y = _nan_loss_problem()
    per_sample = (x @ w - y) ** 2
    return _raises(lambda: PerSampleClip(max_norm=1.0)(per_sample, [w]))


def _step(use_scaler: bool) -> dict[str, Any]:
    w, x, y = _nan_loss_problem()
    start = w.detach().clone()
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16) if use_scaler else None
    if scaler is not None and not scaler.is_enabled():
        raise RuntimeError("torch.amp.GradScaler('cpu') is disabled in this torch build")
    buf = TaskGradBuffer([w])
    loss = ((x @ w - y) ** 2).mean()
    buf.backward(torch.stack([loss]), scaler=scaler)
    out: dict[str, Any] = {"loss": float(loss.detach())}
    if scaler is None:
        out["raised"] = _raises(lambda: buf.apply_(get_balancer("sum")))
        out["grad_unset"] = w.grad is None
        return out
    stats = buf.apply_(get_balancer("sum"), scaler=scaler)
    scaler.unscale_(opt)
    out["pre_clip"] = float(torch.nn.utils.clip_grad_norm_([w], 1.0))
    scaler.step(opt)
    scaler.update()
    out.update(found_inf=bool(stats.found_inf), weights_same=bool(torch.equal(w.detach(), start)),
               scale=float(scaler.get_scale()))
    return out


def compute(quick: bool = False) -> dict[str, Any]:
    w, x, y = _nan_loss_problem()
    loss = ((x @ w - y) ** 2).mean()
    (grad,) = torch.autograd.grad(loss, [w])
    nan_loss = _torch_clip(grad.detach())
    nan_loss["loss"] = float(loss.detach())
    nan_grad = torch.tensor([1.0, NAN, 3.0, 4.0, 5.0])
    inf_grad = torch.tensor([1.0, INF, 3.0, 4.0, 5.0])
    return {"nan_loss": nan_loss, "nan": _torch_clip(nan_grad), "inf": _torch_clip(inf_grad),
            "lib_nan": _library(nan_grad), "lib_inf": _library(inf_grad),
            "per_sample_raised": _per_sample(), "step": _step(False), "step_amp": _step(True)}


def _count(values: list[float], test: Callable[[float], bool]) -> int:
    return sum(test(v) for v in values)


def _rows(rows: list[list[float]]) -> str:
    return "[" + ", ".join("[" + ", ".join(f"{v:.7g}" for v in r) + "]" for r in rows) + "]"


def claims(result: dict[str, Any]) -> list[Claim]:
    nl, nan, inf = result["nan_loss"], result["nan"], result["inf"]
    lib, lib_inf = result["lib_nan"], result["lib_inf"]
    step, amp = result["step"], result["step_amp"]
    n = len(nan["after"])
    return [
        Claim("§Common mistakes: if your loss is already NaN, the gradients are NaN, and scaling "
              "NaN gives NaN — clipping cannot resurrect it",
              f"loss {nl['loss']}; NaN entries before/after clip_grad_norm_: "
              f"{_count(nl['before'], math.isnan)}/{_count(nl['after'], math.isnan)} of {n}, "
              f"returned {nl['returned']}; one NaN entry: {_count(nan['before'], math.isnan)} → "
              f"{_count(nan['after'], math.isnan)} of {n} NaN, returned {nan['returned']}",
              math.isnan(nl["loss"]) and _count(nl["after"], math.isnan) == n
              and math.isnan(nl["returned"]) and _count(nan["after"], math.isnan) == n),
        Claim("§Common mistakes: a non-finite norm stays non-finite (an inf entry is not "
              "resurrected either)",
              f"[1, inf, 3, 4, 5] → returned {inf['returned']}, after {inf['after']}",
              inf["returned"] == INF and _count(inf["after"], math.isnan) == 1
              and _count(inf["after"], lambda v: v == 0.0) == n - 1),
        Claim("§Common mistakes: clip_grad_norm_(error_if_nonfinite=True) raises instead of "
              "scaling, .grad untouched",
              f"NaN loss: {nl['raised']}, untouched {nl['untouched']}; NaN entry: "
              f"{nan['raised']}, untouched {nan['untouched']}; inf entry: {inf['raised']}, "
              f"untouched {inf['untouched']}",
              all(r["raised"] == "RuntimeError" and r["untouched"] for r in (nl, nan, inf))),
        Claim("§Common mistakes (fix the cause, then clip): the library's clippers do not "
              "scale a non-finite gradient: TaskClip keeps the row, AutoClip skips, "
              "error_if_nonfinite raises",
              f"TaskClip on [[30, 40], [NaN, 1]]: pre-clip norms {lib['task_pre']}, rows after "
              f"{_rows(lib['task_rows'])}; strict: {lib['task_raised']}, G unchanged "
              f"{lib['task_unchanged']}; AutoClip: returned {lib['auto_returned']} / "
              f"{lib_inf['auto_returned']}, .grad untouched {lib['auto_untouched']}, history "
              f"{lib['auto_history'][0]} → {lib['auto_history'][1]}, threshold "
              f"{lib['auto_threshold'][0]:.4g} → {lib['auto_threshold'][1]:.4g}; strict "
              f"AutoClip, AGC, PerSampleClip: {lib['auto_raised']}, {lib['agc_raised']}, "
              f"{result['per_sample_raised']}",
              _count(lib["task_rows"][1], math.isnan) == 1 and lib["task_rows"][1][1] == 1.0
              and abs(math.hypot(*lib["task_rows"][0]) - 1.0) < 1e-6
              and lib["task_unchanged"] and lib["auto_untouched"] and lib_inf["auto_untouched"]
              and lib["auto_history"][0] == lib["auto_history"][1] == 3
              and lib["auto_threshold"][0] == lib["auto_threshold"][1]
              and all(x == "NonFiniteGradientError"
                      for x in (lib["task_raised"], lib["auto_raised"], lib["agc_raised"],
                                result["per_sample_raised"]))),
        Claim("§Common mistakes (fix the cause, then clip): the library's step on a NaN "
              "loss: raises without a scaler; with a GradScaler the step is skipped",
              f"no scaler: {step['raised']}, .grad left unset {step['grad_unset']}; "
              f"GradScaler: found_inf {amp['found_inf']}, weights unchanged "
              f"{amp['weights_same']}, scale 65536 → {amp['scale']:.0f}",
              step["raised"] == "NonFiniteGradientError" and step["grad_unset"]
              and amp["found_inf"] and amp["weights_same"] and amp["scale"] == 2.0**15),
    ]


def _grid(ax: Any, rows: list[tuple[str, list[float]]], title: str) -> None:
    codes = [[0 if math.isfinite(v) else 1 if math.isnan(v) else 2 for v in vals]
             for _, vals in rows]
    from matplotlib.colors import ListedColormap

    ax.imshow(codes, cmap=ListedColormap(["#e8f0e8", "#e06060", "#f0a040"]), vmin=0, vmax=2,
              aspect="auto")
    for i, (_, vals) in enumerate(rows):
        for j, v in enumerate(vals):
            ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
    ax.set_xticks(range(len(rows[0][1])), [str(j) for j in range(len(rows[0][1]))])
    ax.set_xlabel("gradient entry")
    ax.set_title(title, fontsize=9)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.6))
    for ax, key in zip(axes, ("nan", "inf")):
        r = result[key]
        _grid(ax, [("gradient", r["before"]),
                   ("after clip_grad_norm_(1)", r["after"]),
                   ("after error_if_nonfinite=True\n(raised)", r["after_strict"]),
                   ("after AutoClip (skipped)", result[f"lib_{key}"]["auto_after"])],
              f"one {'NaN' if key == 'nan' else 'inf'} entry "
              f"(clip_grad_norm_ returned {r['returned']})")
    from matplotlib.patches import Patch

    axes[1].legend(handles=[Patch(color="#e8f0e8", label="finite"),
                            Patch(color="#e06060", label="NaN"),
                            Patch(color="#f0a040", label="inf")],
                   loc="upper left", bbox_to_anchor=(1.02, 1.0), title="entry")
    fig.suptitle(TITLE, fontsize=10)
    save_figure(fig, path)
