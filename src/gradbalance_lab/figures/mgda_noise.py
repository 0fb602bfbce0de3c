"""§8.2 MGDA's combined gradient stops shrinking at the batch-noise level.

Setting: the two-bowl example of :mod:`._common` started at (5, 5); batch noise is added to
each task gradient as independent Gaussian noise of standard deviation σ = 1 per coordinate
(the size of the shallow bowl's gradient one unit from its minimum), drawn fresh every step
from a seeded generator. The library's ``MGDA`` (min-norm point of the convex hull, no
normalisation) through :class:`~gradbalance.TaskGradBuffer`, then ``torch.optim.SGD(lr=0.02)``
for 6,000 steps, 5 runs (seeds 0–4); ``--quick``: 2 runs of 900 steps, the window scaled
to a sixth of the run. The same run without noise is the contrast.

Measured: the mean step size over the last window (the last 1000 of 6000 steps) as a share of
the first step's size, with and without noise; the last window against the one
before it (a plateau gives about 1); and the plateau against the noise level, predicted as
``lr · E‖MGDA(G(w) + ξ)‖`` by Monte Carlo at the points the runs visit in their last window.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from gradbalance_lab.figures._common import Claim, TwoBowls, pyplot, require_balancer, save_figure

NAME = "mgda_noise"
TITLE = "§8.2 MGDA's step size with and without gradient noise"
LR = 0.02
SIGMA = 1.0
START = (5.0, 5.0)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _noise_level(points: list[tuple[float, float]], samples: int, seed: int) -> float:
    """``lr · E‖MGDA(G(w) + ξ)‖`` over ``points``, by Monte Carlo with the library's MGDA."""
    balancer = require_balancer("mgda")
    bowls = TwoBowls()
    gen = torch.Generator().manual_seed(seed)
    sizes = []
    for x, y in points:
        exact = bowls.exact_gradients(torch.tensor([x, y], dtype=torch.float64))
        for _ in range(samples):
            noisy = exact + SIGMA * torch.randn(2, 2, generator=gen, dtype=torch.float64)
            sizes.append(float(balancer(noisy).norm()))
    return LR * _mean(sizes)


def compute(quick: bool = False) -> dict[str, Any]:
    runs, steps = (2, 900) if quick else (5, 6000)
    window = steps // 6
    every = max(1, window // 20)
    noisy_runs = []
    for seed in range(runs):
        bowls = TwoBowls(start=START, noise=SIGMA, seed=seed)
        path = bowls.train(require_balancer("mgda"), lambda p: torch.optim.SGD(p, lr=LR),
                           steps, record_every=every)
        noisy_runs.append(path)
    clean = TwoBowls(start=START).train(require_balancer("mgda"),
                                        lambda p: torch.optim.SGD(p, lr=LR), steps)
    share = [_mean(r["step"][-window:]) / r["step"][0] for r in noisy_runs]
    flat = [_mean(r["step"][-window:]) / _mean(r["step"][-2 * window:-window])
            for r in noisy_runs]
    last_points = [(x, y) for r in noisy_runs
                   for x, y in zip(r["x"][-20:], r["y"][-20:])]
    plateau = _mean([_mean(r["step"][-window:]) for r in noisy_runs])
    predicted = _noise_level(last_points, 20 if quick else 50, seed=100)
    mean_steps = [statistics.fmean(col) for col in zip(*(r["step"] for r in noisy_runs))]
    return {
        "steps": steps, "window": window, "runs": runs,
        "share": share, "share_median": statistics.median(share),
        "share_clean": _mean(clean["step"][-window:]) / clean["step"][0],
        "flat": flat, "plateau": plateau, "predicted": predicted,
        "mean_steps": mean_steps[:: max(1, steps // 1500)], "clean_steps":
        clean["step"][:: max(1, steps // 1500)], "every": max(1, steps // 1500),
        "pareto_end": [r["pareto"][-1] for r in noisy_runs],
    }


def claims(result: dict[str, Any]) -> list[Claim]:
    w = result["window"]
    share = result["share"]
    ratio = result["plateau"] / result["predicted"]
    return [
        Claim(f"with noise, MGDA's step size over the last {w} of {result['steps']} steps as a "
              f"share of the first step ({result['runs']} runs, lr 0.02)",
              "median " + f"{100 * result['share_median']:.1f}% (runs: "
              + ", ".join(f"{100 * s:.1f}%" for s in share)
              + f"); without noise {100 * result['share_clean']:.1e}%",
              result["share_median"] > 100 * result["share_clean"]),
        Claim("... it stops shrinking instead of going to zero (last window / the one before)",
              ", ".join(f"{f:.2f}" for f in result["flat"]),
              all(0.75 < f < 1.33 for f in result["flat"])),
        Claim("... at the size of the batch-to-batch noise (plateau / lr·E‖MGDA(G + noise)‖)",
              f"{result['plateau']:.4f} / {result['predicted']:.4f} = {ratio:.2f}",
              0.75 < ratio < 1.33),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    every = result["every"]
    xs = [i * every for i in range(len(result["mean_steps"]))]
    ax.semilogy(xs, result["mean_steps"], label=f"with noise σ = {SIGMA} (mean of runs)")
    ax.semilogy(xs, [max(s, 1e-18) for s in result["clean_steps"]], "--", label="exact gradients")
    ax.axhline(result["predicted"], color="grey", ls=":", label="noise level")
    ax.set_xlabel("step")
    ax.set_ylabel("step size ‖Δw‖")
    ax.set_title(TITLE)
    ax.legend()
    save_figure(fig, path)
