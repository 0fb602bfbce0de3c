"""Clip tutorial, Why it exists / Try it yourself / Common mistakes: an exploding run.

Setting: the small 3-task MLP of the ``clipping`` figure (8 inputs, trunk 32×2, targets
scaled 1, 10, 0.1, batches of 32 from 512 samples), the library's step with ``Mean``, then
``torch.optim.SGD`` for 200 steps (Adam's per-coordinate scale would hide the explosion).
The text's recipe: a healthy run logs ``clip_grad_norm_``'s return value; its 95th
percentile is the limit τ; the learning rate times 10 is then run unclipped and clipped at
τ, with the same initial weights and batches. Two healthy learning rates are run, 0.01 and
0.03 (both learn: the loss falls from about 62 to under 1), so lr 0.1 and 0.3.

Pass rules, fixed before measuring: a run *diverges* when its loss turns non-finite (NaN or
inf, the text's "the loss suddenly reads NaN", the model "effectively dead") or ends above
its starting loss; it *survives* when every loss of the 200 steps is finite. Whether a
survivor also learned (last loss below the first) is reported beside it. The healthy run's
norms after a 50-step warm-up *wander within a band* when none exceeds twice its p95; a
*spike* is a norm above ten times the healthy p95. "Try it yourself" (multiply the learning
rate by 10 and watch the seismograph, "explosions on demand, safely") is read as the clipped
run at lr × 10 (the one that is safe), its logged ``clip_grad_norm_`` return: met when, for
both healthy rates, its largest value is a spike and every loss of the run is finite.

Clipping in the wrong place, at lr 0.3: ``clip_grad_norm_`` before ``backward()`` (after
``zero_grad``) finds no gradient and returns 0; after ``optimizer.step()`` it clips a
gradient the step already used. The control is the unclipped run: both misplaced runs are
expected to repeat its losses exactly, explosion included.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "clip_explode"
TITLE = "Clip tutorial: an exploding run (lr × 10), clipped, unclipped and clipped wrongly"
STEPS = 200
WARMUP = 50
HEALTHY = (0.01, 0.03)
PLACES = ("none", "right", "before backward", "after step")
MISTAKES = {"before backward": "there is nothing to clip",
            "after step": "the damage is already applied"}


def _p95(values: list[float]) -> float:
    """Linear-interpolation 95th percentile (numpy's default), written out by sorting."""
    xs = sorted(values)
    pos = (len(xs) - 1) * 0.95
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _clip(model: torch.nn.Module, tau: float) -> float:
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), tau))


def train(lr: float, tau: float = math.inf, place: str = "right",
          seed: int = 0) -> dict[str, list[float]]:
    """Losses and ``clip_grad_norm_`` returns of one SGD run, clipped at ``tau`` in
    ``place``; it stops at the first non-finite loss."""
    torch.manual_seed(seed)
    x = torch.randn(512, 8)
    targets = torch.stack([(x @ torch.randn(8)) * s for s in (1.0, 10.0, 0.1)], dim=1)
    model = MultiTaskModel(mlp_trunk(8, 32, 2), make_heads(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer("mean")
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, list[float]] = {"loss": [], "norm": []}
    for _ in range(STEPS):
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        losses = regression_losses(model(x[idx]), targets[idx])
        out["loss"].append(float(losses.detach().mean()))
        if not math.isfinite(out["loss"][-1]):
            break
        if place == "before backward":
            out["norm"].append(_clip(model, tau))
        buf.backward(losses)
        buf.apply_(balancer)
        if place in ("none", "right"):
            out["norm"].append(_clip(model, tau if place == "right" else math.inf))
        opt.step()
        if place == "after step":
            out["norm"].append(_clip(model, tau))
        opt.zero_grad(set_to_none=True)
    return out


def compute(quick: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = {"steps": STEPS}
    for lr in HEALTHY:
        healthy = train(lr, place="none")
        tau = _p95(healthy["norm"])
        runs = {"healthy": healthy, "unclipped": train(10 * lr, place="none"),
                "clipped": train(10 * lr, tau)}
        if lr == HEALTHY[-1]:
            for place in PLACES[2:]:
                runs[place] = train(10 * lr, tau, place)
        result[lr] = {"tau": tau, "runs": runs}
    return result


def _diverged(loss: list[float]) -> bool:
    return not math.isfinite(loss[-1]) or loss[-1] > loss[0]


def _survived(loss: list[float]) -> bool:
    return len(loss) == STEPS and all(map(math.isfinite, loss))


def _end(run: dict[str, list[float]]) -> str:
    loss = run["loss"]
    if not math.isfinite(loss[-1]):
        return f"loss {loss[-1]} at step {len(loss)}"
    learned = "learned" if loss[-1] < loss[0] else "finite, not learning"
    return f"loss {loss[0]:.3g} → {loss[-1]:.3g} after {len(loss)} steps ({learned})"


def claims(result: dict[str, Any]) -> list[Claim]:
    out = []
    for lr in HEALTHY:
        runs, tau = result[lr]["runs"], result[lr]["tau"]
        hot, clipped = runs["unclipped"], runs["clipped"]
        share = sum(n > tau for n in clipped["norm"]) / len(clipped["norm"])
        out.append(Claim(
            f"clip tutorial §Why it exists: lr × 10 ({lr:g} → {10 * lr:g}) "
            f"explodes unclipped; clipping at the healthy run's p95 makes it survivable",
            f"healthy: {_end(runs['healthy'])}; unclipped: {_end(hot)}; clipped at τ = "
            f"{tau:.3g}: {_end(clipped)} ({100 * share:.0f}% of its steps clipped)",
            _diverged(hot["loss"]) and _survived(clipped["loss"])))
    seismo = {lr: (max(result[lr]["runs"]["clipped"]["norm"]) / result[lr]["tau"],
                   _survived(result[lr]["runs"]["clipped"]["loss"])) for lr in HEALTHY}
    out.append(Claim(
        "clip tutorial §Try it yourself: the seismograph at lr × 10 shows explosions on "
        "demand, safely (the clipped run's logged pre-clip norm)",
        "; ".join(f"lr {lr:g} → {10 * lr:g}: largest pre-clip norm {ratio:.1f} × the healthy "
                  f"p95 (spike: over 10×), all {STEPS} losses finite: {alive}"
                  for lr, (ratio, alive) in seismo.items()),
        all(ratio > 10 and alive for ratio, alive in seismo.values())))
    runs, tau = result[HEALTHY[0]]["runs"], result[HEALTHY[0]]["tau"]
    band = max(runs["healthy"]["norm"][WARMUP:])
    spike = max(runs["unclipped"]["norm"])
    out.append(Claim(
        "clip tutorial §The walkthrough: the logged pre-clip norm wanders within a band in "
        "healthy training; trouble shows spikes",
        f"lr {HEALTHY[0]:g}, after {WARMUP} steps: largest norm {band:.3g} = "
        f"{band / tau:.2f} × its p95 {tau:.3g} (band: at most 2×); lr {10 * HEALTHY[0]:g}: "
        f"largest {spike:.3g} = {spike / tau:.0f} × (spike: over 10×)",
        band <= 2 * tau and spike > 10 * tau))
    runs = result[HEALTHY[-1]]["runs"]
    hot = runs["unclipped"]["loss"]
    for place in PLACES[2:]:
        wrong = runs[place]
        out.append(Claim(
            f"clip tutorial §Common mistakes: clipping {place} "
            f"({MISTAKES[place]})",
            f"lr {10 * HEALTHY[-1]:g}: {_end(wrong)}; clip_grad_norm_ returned "
            f"{wrong['norm'][0]:.3g} at the first step; losses equal the unclipped run's: "
            f"{wrong['loss'] == hot}",
            wrong["loss"] == hot and _diverged(hot)
            and (place != "before backward" or max(wrong["norm"]) == 0.0)))
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6))
    lr = HEALTHY[0]
    runs, tau = result[lr]["runs"], result[lr]["tau"]
    for key, color, label in (("healthy", "C0", f"healthy, lr {lr:g}"),
                              ("unclipped", "C3", f"lr {10 * lr:g}, unclipped"),
                              ("clipped", "C2", f"lr {10 * lr:g}, clipped at τ")):
        ax1.semilogy(runs[key]["norm"], color=color, lw=0.9, label=label)
    ax1.axhline(tau, color="k", ls="--", lw=0.8, label=f"τ = healthy p95 = {tau:.3g}")
    ax1.axhline(10 * tau, color="grey", ls=":", lw=0.8, label="spike: 10 τ")
    ax1.set_xlabel("step")
    ax1.set_ylabel("clip_grad_norm_ return (pre-clip norm)")
    ax1.set_title("the seismograph: band vs spikes", fontsize=10)
    ax1.legend(fontsize=8)
    lr = HEALTHY[-1]
    runs = result[lr]["runs"]
    styles = {"healthy": ("C0", "-"), "unclipped": ("C3", "-"), "clipped": ("C2", "-"),
              "before backward": ("C4", "--"), "after step": ("C1", ":")}
    for key, (color, ls) in styles.items():
        loss = runs[key]["loss"]
        finite = [v if math.isfinite(v) else float("nan") for v in loss]
        label = key if key != "healthy" else f"healthy, lr {lr:g}"
        if not math.isfinite(loss[-1]):
            label += f" (non-finite at step {len(loss)})"
        ax2.semilogy(finite, color=color, ls=ls, lw=1.2, label=label)
    ax2.set_xlabel("step")
    ax2.set_ylabel("mean task loss")
    ax2.set_title(f"lr {10 * lr:g}: clipped survives; clipped in the wrong place does not",
                  fontsize=10)
    ax2.legend(fontsize=8)
    fig.suptitle(TITLE)
    save_figure(fig, path)
