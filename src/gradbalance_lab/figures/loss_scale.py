"""§5 Loss scale: the sum reduction's gradient is n times the mean's, in the same direction.

Setting: a trunk ``Linear(4, 8) + tanh`` and one ``Linear(8, 1)`` head, a batch of n
samples (n = 8, 32, 128, 512; one output each, so n elements). The same predictions and
targets give two task losses, ``MSELoss()`` (mean) and ``MSELoss(reduction="sum")``;
:func:`gradbalance.task_gradients` returns their trunk gradients as the two rows of ``G``, and
the Gramian gives the length ratio and the cosine. Closed form: ratio n, cosine 1.

Shown alongside: two different tasks combined by the ``Sum`` balancer, once both with mean
reduction and once with task 1 summed; the cosine of the combined step with each task (from
:class:`~gradbalance.StepStats`) shows a gradient method feeling the scale directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradbalance.balancers import get_balancer
from gradbalance.gramian import compute_gramian, cosine_matrix
from gradbalance.step import balanced_backward
from gradbalance.taskgrads import task_gradients
from gradbalance_lab.figures._common import Claim, pyplot, save_figure

NAME = "loss_scale"
TITLE = "§5 Loss scale: mean vs sum reduction"
SIZES = (8, 32, 128, 512)


def _model(seed: int) -> tuple[nn.Module, nn.Module, nn.Module]:
    torch.manual_seed(seed)
    trunk = nn.Sequential(nn.Linear(4, 8), nn.Tanh())
    return trunk, nn.Linear(8, 1), nn.Linear(8, 1)


def compute(quick: bool = False) -> dict[str, Any]:
    ratios, cosines = [], []
    for n in SIZES:
        trunk, head, _ = _model(0)
        gen = torch.Generator().manual_seed(n)
        x, y = torch.randn(n, 4, generator=gen), torch.randn(n, 1, generator=gen)
        pred = head(trunk(x))
        losses = [nn.MSELoss()(pred, y), nn.MSELoss(reduction="sum")(pred, y)]
        gram = compute_gramian(task_gradients(losses, list(trunk.parameters())).double())
        ratios.append(float((gram[1, 1] / gram[0, 0]).sqrt()))
        cosines.append(float(cosine_matrix(gram)[0, 1]))
    shares = {}
    for label, reductions in (("mean+mean", ("mean", "mean")), ("sum+mean", ("sum", "mean"))):
        trunk, h1, h2 = _model(1)
        gen = torch.Generator().manual_seed(7)
        x, y = torch.randn(64, 4, generator=gen), torch.randn(64, 2, generator=gen)
        feats = trunk(x)
        losses = [nn.MSELoss(reduction=reductions[0])(h1(feats), y[:, :1]),
                  nn.MSELoss(reduction=reductions[1])(h2(feats), y[:, 1:])]
        stats = balanced_backward(losses, get_balancer("sum"),
                                  shared_params=list(trunk.parameters()),
                                  head_params=[*h1.parameters(), *h2.parameters()])
        cosines_to_update = stats.cosine_to_update
        assert cosines_to_update is not None
        shares[label] = cosines_to_update.tolist()
    return {"n": list(SIZES), "ratio": ratios, "cosine": cosines, "cos_to_update": shares}


def claims(result: dict[str, Any]) -> list[Claim]:
    ratio, cos = result["ratio"], result["cosine"]
    rel = max(abs(r / n - 1) for r, n in zip(ratio, result["n"]))
    mm, sm = result["cos_to_update"]["mean+mean"], result["cos_to_update"]["sum+mean"]
    return [
        Claim("§5 the sum reduction's gradient is n times the mean's",
              "‖g_sum‖/‖g_mean‖ = " + ", ".join(f"{r:.6g}" for r in ratio)
              + f" for n = {', '.join(map(str, result['n']))}", rel < 1e-5),
        Claim("§5 ... in the same direction", f"min cosine {min(cos):.8f}", min(cos) > 1 - 1e-6),
        Claim("§5 gradient methods feel a loss scale directly (Sum balancer, 64 samples)",
              f"cos(step, task) mean+mean: {mm[0]:.2f}, {mm[1]:.2f}; task 1 summed: "
              f"{sm[0]:.2f}, {sm[1]:.2f}"),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(result["n"], result["ratio"], "o-", label="measured ‖g_sum‖ / ‖g_mean‖")
    ax.loglog(result["n"], result["n"], "k:", label="n")
    ax.set_xlabel("elements n in the batch")
    ax.set_ylabel("gradient length ratio")
    ax.set_title(TITLE)
    ax.legend()
    save_figure(fig, path)
