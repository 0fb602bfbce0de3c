"""Clip tutorial, The walkthrough: with gradient accumulation, clip once per update.

Setting (float64, so rounding is ~1e-16): a 3-task model (MLP trunk 8→16→16, linear heads,
seeded) at its initial weights; 20 batches (5 with ``--quick``) of 32 samples, each split into
M = 4 micro-batches of 8. The limit τ = 2.75 is about the median full-batch gradient norm
(half of the updates are clipped); a micro-batch's gradient is noisier, about twice as long.

* once per update: the library's step accumulates the 4 micro-batches
  (``TaskGradBuffer.backward(losses / M)`` each, ``apply_(Sum())`` once), then
  ``clip_grad_norm_(τ)`` on the finished pile; compared with one backward of the whole batch
  of 32, clipped the same way;
* per micro-batch: each micro-batch's gradient (``backward(losses)``, ``apply_``) is clipped
  at τ on its own, then the 4 clipped gradients are averaged.

Reported: the angle between the two updates, their lengths, and how far the once-per-update
pile is from the full batch's gradient (rounding only).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, angle_deg, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "clip_accumulation"
TITLE = "Clip tutorial, The walkthrough: clip once per update, not per micro-batch"
TAU = 2.75
MICRO = 4
BATCH = 32


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step has set."""
    assert p.grad is not None
    return p.grad


def setup(batches: int, seed: int = 0) -> tuple[MultiTaskModel, torch.Tensor, torch.Tensor]:
    """The model (float64) and ``batches`` batches ``[batches, 32, 8]``, ``[batches, 32, 3]``."""
    torch.manual_seed(seed)
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, 3)).double()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batches, BATCH, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(batches, BATCH, 3, generator=gen, dtype=torch.float64) * 3
    return model, x, y


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([_grad(p).reshape(-1) for p in model.parameters()]).clone()


def _step(model: MultiTaskModel, xs: list[torch.Tensor], ys: list[torch.Tensor],
          clip_each: bool) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """(pile before clipping, update, pre-clip norms) for micro-batches ``xs``."""
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer("sum")
    model.zero_grad(set_to_none=True)
    if not clip_each:
        for x, y in zip(xs, ys):
            buf.backward(regression_losses(model(x), y) / len(xs))
        buf.apply_(balancer)
        pile = _flat(model)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), TAU))
        return pile, _flat(model), [norm]
    total, norms = None, []
    for x, y in zip(xs, ys):
        model.zero_grad(set_to_none=True)
        buf.backward(regression_losses(model(x), y))
        buf.apply_(balancer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), TAU)))
        part = _flat(model) / len(xs)
        total = part if total is None else total + part
    assert total is not None
    return total, total, norms


def compute(quick: bool = False) -> dict[str, Any]:
    model, x, y = setup(5 if quick else 20)
    rows: list[dict[str, Any]] = []
    for xb, yb in zip(x, y):
        xs, ys = list(xb.split(BATCH // MICRO)), list(yb.split(BATCH // MICRO))
        pile, once, (norm,) = _step(model, xs, ys, clip_each=False)
        full_pile, full, (full_norm,) = _step(model, [xb], [yb], clip_each=False)
        _, each, micro_norms = _step(model, xs, ys, clip_each=True)
        rows.append({
            "norm": norm, "full_norm": full_norm, "micro_norms": micro_norms,
            "pile_gap": float((pile - full_pile).norm() / full_pile.norm()),
            "once_gap": float((once - full).norm() / full.norm()),
            "once_len": float(once.norm()), "each_len": float(each.norm()),
            "angle": angle_deg(once, each),
            "each_gap": float((each - once).norm() / once.norm()),
        })
    return {"rows": rows, "tau": TAU, "micro": MICRO}


def claims(result: dict[str, Any]) -> list[Claim]:
    rows = result["rows"]
    tau = result["tau"]
    pile_gap = max(r["pile_gap"] for r in rows)
    once_gap = max(r["once_gap"] for r in rows)
    norm_gap = max(abs(r["norm"] - r["full_norm"]) / r["full_norm"] for r in rows)
    clipped_once = sum(r["norm"] > tau for r in rows)
    clipped_micro = sum(n > tau for r in rows for n in r["micro_norms"])
    angles = [r["angle"] for r in rows]
    ratio = [r["each_len"] / r["once_len"] for r in rows]
    # float64: the pile and the full batch differ by rounding (~1e-16 per term)
    return [
        Claim("§The walkthrough: with gradient accumulation, clip once per update on the "
              "finished pile",
              f"{len(rows)} updates of {result['micro']} micro-batches: pile vs full-batch "
              f"gradient {pile_gap:.1e} (relative), pre-clip norm {norm_gap:.1e}, clipped "
              f"update {once_gap:.1e}; {clipped_once} of {len(rows)} updates clipped at "
              f"τ = {tau}",
              pile_gap < 1e-12 and once_gap < 1e-12 and norm_gap < 1e-12),
        Claim("§The walkthrough: ... never per micro-batch (each micro-batch clipped at τ, "
              "then averaged)",
              f"{clipped_micro} of {len(rows) * result['micro']} micro-batches clipped; angle "
              f"to the once-per-update step median {statistics.median(angles):.1f}° (max "
              f"{max(angles):.1f}°); length ratio median {statistics.median(ratio):.2f} "
              f"(min {min(ratio):.2f}); smallest difference "
              f"{min(r['each_gap'] for r in rows):.2g} (relative) against rounding "
              f"{max(pile_gap, 1e-16):.1e}",
              min(r["each_gap"] for r in rows) > 1e6 * max(pile_gap, 1e-16)),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    rows = result["rows"]
    idx = list(range(len(rows)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(idx, [r["angle"] for r in rows], color="C3",
            label="per micro-batch vs once per update")
    ax1.set_xlabel("update (batch of 32 = 4 micro-batches of 8)")
    ax1.set_ylabel("angle between the two updates (degrees)")
    ax1.set_ylim(0.0, max(r["angle"] for r in rows) * 1.25)
    ax1.legend(loc="upper left")
    ax1.set_title("direction: clipping per micro-batch turns the update")
    ax2.plot(idx, [r["full_norm"] for r in rows], "o", color="lightgrey",
             label="full-batch gradient (before clipping)")
    ax2.plot(idx, [r["once_len"] for r in rows], "o-", color="C0",
             label="clipped once per update")
    ax2.plot(idx, [r["each_len"] for r in rows], "s--", color="C3",
             label="clipped per micro-batch, averaged")
    ax2.axhline(result["tau"], color="k", lw=0.8, ls=":", label=f"τ = {result['tau']}")
    ax2.set_xlabel("update (batch of 32 = 4 micro-batches of 8)")
    ax2.set_ylabel("update norm")
    top = max(r["full_norm"] for r in rows)
    ax2.set_ylim(0.0, top * 1.75)
    ax2.legend(loc="upper left", fontsize=8)
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.set_title("length: per micro-batch shrinks more")
    fig.suptitle(TITLE)
    save_figure(fig, path)
