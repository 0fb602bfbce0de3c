"""§11 The text's ``torch.amp.GradScaler()`` step on a CPU-only machine.

Setting: the text's mixed-precision step, written out as in the text (its ``flat_grad``,
``fill_grads``, ``scaler.scale`` per task loss, ``sizes = G.norm(dim=1) / s``,
``scaler.unscale_``, ``clip_grad_norm_(params, 1.0)``, ``scaler.step``, ``scaler.update`` and
``skipped = scaler.get_scale() < s``), on a 2-task regression model (MLP trunk 6→16→16,
linear heads, float32, batch 32, seeded) with ``torch.optim.SGD(lr=0.01)``, for 4 steps; at
step 2 task 0's loss is multiplied by inf (an overflow). Run twice from the same weights:
with the text's ``torch.amp.GradScaler()`` (its device defaults to ``"cuda"``) and with
``torch.amp.GradScaler("cpu")``. The true sizes are the norms of the unscaled task gradients
(``torch.autograd.grad`` on a fresh forward).

On a machine without CUDA the default scaler warns and disables itself: ``scale`` returns the
loss unchanged, ``get_scale()`` is 1, ``unscale_``, ``step`` and ``update`` do nothing of
their own, so the overflow reaches the weights and ``skipped`` never fires. The CPU scaler
scales by 2¹⁶, skips the overflowing step and halves its scale.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.autograd import grad

from gradbalance_lab.figures._common import Claim, grad_of, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "amp_cpu"
TITLE = "§11 GradScaler() on a CPU-only machine, and GradScaler('cpu')"
STEPS = 4
BAD_STEP = 2
MAX_NORM = 1.0


def _setup() -> tuple[MultiTaskModel, Tensor, Tensor]:
    torch.manual_seed(0)
    model = MultiTaskModel(mlp_trunk(6, 16, 2), make_heads(16, 2))
    gen = torch.Generator().manual_seed(1)
    return model, torch.randn(32, 6, generator=gen), torch.randn(32, 2, generator=gen)


def _flat(grads: tuple[Tensor, ...]) -> Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def _fill_grads(params: Sequence[Tensor], vec: Tensor) -> None:
    i = 0
    for p in params:
        n = p.numel()
        p.grad = vec[i:i + n].view_as(p).clone()
        i += n


def _run(make_scaler: Any) -> dict[str, Any]:
    """The text's step, ``STEPS`` times, with the scaler ``make_scaler()`` builds."""
    model, x, y = _setup()
    body, head_ps = model.shared_parameters(), model.head_parameters()
    params = body + head_ps
    opt = torch.optim.SGD(params, lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = make_scaler()
    probe = torch.ones((), requires_grad=True) * 3.0
    out: dict[str, Any] = {
        "enabled": scaler.is_enabled(), "warning": "; ".join(str(w.message) for w in caught),
        "scale_returns_loss": scaler.scale(probe) is probe, "steps": []}
    for step in range(STEPS):
        true_losses = regression_losses(model(x), y)
        true_sizes = [float(_flat(grad(true_losses[k], body, retain_graph=True)).norm())
                      for k in range(2)]
        losses = list(regression_losses(model(x), y))
        if step == BAD_STEP:
            losses[0] = losses[0] * math.inf
        rows = []
        for L in losses:  # s times big
            big = scaler.scale(L)
            rows.append(_flat(grad(big, body, retain_graph=True)))
        G = torch.stack(rows)
        s = scaler.get_scale()
        sizes = (G.norm(dim=1) / s).tolist()
        opt.zero_grad()
        _fill_grads(body, G.sum(dim=0))
        total = scaler.scale(sum(losses))
        torch.autograd.backward(total, inputs=head_ps)
        scaler.unscale_(opt)
        pre_clip = float(torch.nn.utils.clip_grad_norm_(params, MAX_NORM))
        before = [p.detach().clone() for p in params]
        scaler.step(opt)
        scaler.update()
        skipped = scaler.get_scale() < s
        weights = torch.cat([p.detach().reshape(-1) for p in params])
        out["steps"].append({
            "s": float(s), "sizes": sizes, "true_sizes": true_sizes,
            "scaled_norms": G.norm(dim=1).tolist(), "pre_clip": pre_clip,
            "skipped": bool(skipped), "scale_after": float(scaler.get_scale()),
            "unchanged": all(torch.equal(a, p.detach()) for a, p in zip(before, params)),
            "nonfinite": int((~torch.isfinite(weights)).sum()), "weights": weights.numel(),
            "grad_finite": all(bool(torch.isfinite(grad_of(p)).all()) for p in params),
        })
    return out


def compute(quick: bool = False) -> dict[str, Any]:
    return {"cuda": torch.cuda.is_available(), "default": _run(lambda: torch.amp.GradScaler()),
            "cpu": _run(lambda: torch.amp.GradScaler("cpu"))}


def _size_gap(run: dict[str, Any]) -> float:
    return float(max(abs(a / b - 1) for st in run["steps"] if st["sizes"][0] < math.inf
                     for a, b in zip(st["sizes"], st["true_sizes"])))


def claims(result: dict[str, Any]) -> list[Claim]:
    d, c = result["default"], result["cpu"]
    bad_d, bad_c = d["steps"][BAD_STEP], c["steps"][BAD_STEP]
    good_c = [st for i, st in enumerate(c["steps"]) if i != BAD_STEP]
    cpu_only = not result["cuda"]
    return [
        Claim("§11 torch.amp.GradScaler() (the text's snippet) on a CPU-only machine disables "
              "itself", f"is_enabled() {d['enabled']}; get_scale() {d['steps'][0]['s']:g}; "
              f"scale(L) returns L: {d['scale_returns_loss']}; warning: '{d['warning']}'",
              (not d["enabled"] and d["steps"][0]["s"] == 1.0 and d["scale_returns_loss"])
              if cpu_only else None),
        Claim("§11 ... so the snippet runs unscaled and never skips: the overflow reaches the "
              "weights", f"step {BAD_STEP}: skipped {bad_d['skipped']}; non-finite weights "
              f"after it {bad_d['nonfinite']} of {bad_d['weights']}; true sizes as printed "
              f"(s = 1) to {_size_gap(d):.0e}",
              (not bad_d["skipped"] and bad_d["nonfinite"] > 0) if cpu_only else None),
        Claim("§11 torch.amp.GradScaler('cpu') is enabled: every task carries s, sizes divided "
              "by s are the true ones",
              f"s = {c['steps'][0]['s']:g}; scaled ‖G_k‖ {c['steps'][0]['scaled_norms'][0]:.4g},"
              f" {c['steps'][0]['scaled_norms'][1]:.4g}; ‖G_k‖/s vs true sizes to "
              f"{_size_gap(c):.0e}; pre-clip norm after unscale_ vs the disabled run "
              f"{c['steps'][0]['pre_clip']:.6g} / {d['steps'][0]['pre_clip']:.6g}",
              c["enabled"] and c["steps"][0]["s"] == 2.0**16 and _size_gap(c) < 1e-5
              and abs(c["steps"][0]["pre_clip"] / d["steps"][0]["pre_clip"] - 1) < 1e-5),
        Claim("§11 when a scaled gradient overflows the scaler skips the step (GradScaler('cpu'))",
              f"step {BAD_STEP}: skipped {bad_c['skipped']}, weights unchanged "
              f"{bad_c['unchanged']}, scale {bad_c['s']:g} → {bad_c['scale_after']:g}; other "
              f"steps skipped: {sum(st['skipped'] for st in good_c)}",
              bad_c["skipped"] and bad_c["unchanged"] and bad_c["nonfinite"] == 0
              and not any(st["skipped"] for st in good_c)),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = list(range(STEPS))
    for key, label, style in (("default", "GradScaler() (disabled on CPU)", "o-"),
                              ("cpu", "GradScaler('cpu')", "s--")):
        run = result[key]
        ax1.semilogy(steps, [st["s"] for st in run["steps"]], style, base=2, label=label)
        ax2.plot(steps, [st["nonfinite"] / st["weights"] for st in run["steps"]], style,
                 label=label)
    for ax in (ax1, ax2):
        ax.axvline(BAD_STEP, color="C3", lw=0.8, ls=":")
        ax.set_xticks(steps)
        ax.set_xlabel(f"step (overflow injected at step {BAD_STEP})")
        ax.legend(fontsize=8)
    ax1.set_ylabel("scale s used in the step (log₂)")
    ax1.set_title("the scale each step runs with", fontsize=10)
    ax2.set_ylabel("share of non-finite weights after the step")
    ax2.set_ylim(-0.05, 1.05)
    ax2.set_title("what the overflow does to the weights", fontsize=10)
    fig.suptitle(TITLE)
    save_figure(fig, path)
