"""§9.1 Renormalising GradNorm's weights.

Setting: a 3-task regression model (MLP trunk 8→32→32, linear heads; targets scaled 1, 10,
0.1; batches of 32 from 512 seeded samples), the network stepped by
``torch.optim.Adam(lr=1e-3)`` through :class:`~gradbalance.TaskGradBuffer` with the ``Sum``
balancer on the GradNorm-weighted losses. The library's ``GradNorm`` (α = 1.5, the paper's
Adam at lr 0.025 on the weights, the trunk's last layer as ``W``) with
``renormalize=True`` (the paper's rescale to sum K inside ``no_grad``) and
``renormalize=False``; 300 steps (100 with ``--quick``), the same batches for both.

Measured: the sum of the K = 3 weights after every update: its largest distance from K with
and without the rescale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, require_attr, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "gradnorm"
TITLE = "§9.1 GradNorm's weights with and without renormalisation"
K = 3


def _run(renormalize: bool, steps: int) -> dict[str, list[Any]]:
    gradnorm_cls = require_attr("weighting", "GradNorm")
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    targets = torch.stack([(x @ torch.randn(8)) * s for s in (1.0, 10.0, 0.1)], dim=1)
    model = MultiTaskModel(mlp_trunk(8, 32, 2), make_heads(32, K))
    weighting = gradnorm_cls(K, model.trunk, alpha=1.5, lr=0.025, renormalize=renormalize)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer("sum")
    gen = torch.Generator().manual_seed(1)
    sums, weights = [], []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        losses = regression_losses(model(x[idx]), targets[idx])
        buf.backward(weighting(losses))
        buf.apply_(balancer)
        opt.step()
        weighting.update()
        opt.zero_grad(set_to_none=True)
        w = weighting.weights
        sums.append(float(w.sum()))
        weights.append(w.tolist())
    return {"sum": sums, "weights": weights}


def compute(quick: bool = False) -> dict[str, Any]:
    steps = 100 if quick else 300
    on, off = _run(True, steps), _run(False, steps)
    return {
        "steps": steps, "on": on, "off": off,
        "drift_on": max(abs(s - K) for s in on["sum"]),
        "drift_off": max(abs(s - K) for s in off["sum"]),
        "end_off": off["sum"][-1],
    }


def claims(result: dict[str, Any]) -> list[Claim]:
    return [
        Claim("with the rescale after every step the weights sum to K = 3",
              f"largest |Σw − 3| over {result['steps']} steps: {result['drift_on']:.1e}",
              result["drift_on"] < 1e-9),
        Claim("without it the sum drifts (and acts as a learning-rate change)",
              f"largest |Σw − 3|: {result['drift_off']:.3f}; sum at the end "
              f"{result['end_off']:.3f}", result["drift_off"] > 0.05),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(result["on"]["sum"], label="renormalize=True")
    ax1.plot(result["off"]["sum"], label="renormalize=False")
    ax1.axhline(K, color="grey", lw=0.8)
    ax1.set_xlabel("step")
    ax1.set_ylabel("sum of the weights")
    ax1.set_title("Σw")
    ax1.legend()
    for key, style in (("on", "-"), ("off", "--")):
        columns = list(zip(*result[key]["weights"]))
        for k, col in enumerate(columns):
            ax2.plot(col, style, color=f"C{k}",
                     label=f"task {k} ({'renormalised' if key == 'on' else 'free'})")
    ax2.set_xlabel("step")
    ax2.set_ylabel("weight")
    ax2.set_title("each task's weight")
    ax2.legend(fontsize=7)
    fig.suptitle(TITLE)
    save_figure(fig, path)
