"""§5 Loss scale: the sum reduction's gradient is n times the mean's, in the same direction.

Setting: a trunk ``Linear(4, 8) + tanh`` and one ``Linear(8, 1)`` head, a batch of n
samples (n = 8, 32, 128, 512; one output each, so n elements). The same predictions and
targets give two task losses, ``MSELoss()`` (mean) and ``MSELoss(reduction="sum")``;
:func:`gradbalance.task_gradients` returns their trunk gradients as the two rows of ``G``, and
the Gramian gives the length ratio and the cosine. Closed form: ratio n, cosine 1.

"Gradient methods feel it directly": two different tasks on a shared trunk (64 samples,
mean reduction), their trunk gradients ``G`` from :func:`gradbalance.task_gradients`; each
gradient method the text names (``PCGrad``, ``GradVac``, ``CAGrad``, ``MGDA``, the library's
balancers at their defaults) combines ``G`` and then ``G`` with task 1's loss times 10 (a
constant factor, row 1 times 10). The claim is met when every method's combined direction
turns by more than 1°; for PCGrad and MGDA the turn is also compared with the two-task closed
forms of :mod:`._common`. The ``Sum`` combine (not a gradient method) is shown beside them.

"Loss-weighting methods undo a constant scale once their weights adapt": the library's
``UncertaintyWeighting`` (regression) learns its ``log σ²`` with ``torch.optim.Adam(lr=0.05)``
for 500 steps on fixed losses ``(L₁, 2)``, once with ``L₁ = 2`` and once ``L₁ = 20``. Its
weight times the loss scale is what the weighted gradient carries; the closed form of the
stationary point (``e^{−s} = 1/(2·½·L)``) makes ``w₁·L₁`` the same for both, so the ratio
``w₁(20)·10 / w₁(2)`` is expected to be 1 (within 1e-3 once adapted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradbalance.gramian import compute_gramian, cosine_matrix
from gradbalance.taskgrads import task_gradients
from gradbalance_lab.figures._common import (
    KERNELS,
    Claim,
    angle_deg,
    pyplot,
    require_attr,
    require_balancer,
    save_figure,
)

NAME = "loss_scale"
TITLE = "§5 Loss scale: mean vs sum reduction"
SIZES = (8, 32, 128, 512)
METHODS = ("pcgrad", "gradvac", "cagrad", "mgda")
FACTOR = 10.0
UW_STEPS = 500


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
    return {"n": list(SIZES), "ratio": ratios, "cosine": cosines, **_methods(),
            "uw": {scale: _uw_weight(scale) for scale in (1.0, FACTOR)}}


def _methods() -> dict[str, Any]:
    """Turn of each combine's direction when task 1's loss is ``FACTOR`` times larger."""
    trunk, h1, h2 = _model(1)
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(64, 4, generator=gen), torch.randn(64, 2, generator=gen)
    feats = trunk(x)
    losses = [nn.MSELoss()(h1(feats), y[:, :1]), nn.MSELoss()(h2(feats), y[:, 1:])]
    g = task_gradients(losses, list(trunk.parameters())).double().detach()
    scaled = g * torch.tensor([[FACTOR], [1.0]], dtype=torch.float64)
    turns = {name: angle_deg(require_balancer(name)(g), require_balancer(name)(scaled))
             for name in (*METHODS, "sum")}
    closed = {name: angle_deg(KERNELS[name](g), KERNELS[name](scaled))
              for name in ("pcgrad", "mgda")}
    between = angle_deg(g[0], g[1])
    return {"turns": turns, "closed": closed, "between": between}


def _uw_weight(scale: float) -> float:
    """Uncertainty Weighting's learned weight of task 1 with losses ``(2·scale, 2)``."""
    uw_cls = require_attr("weighting", "UncertaintyWeighting")
    uw = uw_cls(2, dtype=torch.float64)
    opt = torch.optim.Adam(uw.parameters(), lr=0.05)
    losses = torch.tensor([2.0 * scale, 2.0], dtype=torch.float64)
    for _ in range(UW_STEPS):
        uw(losses).sum().backward()
        opt.step()
        uw.update()
        opt.zero_grad(set_to_none=True)
    return float(uw.weights[0])


def claims(result: dict[str, Any]) -> list[Claim]:
    ratio, cos = result["ratio"], result["cosine"]
    rel = max(abs(r / n - 1) for r, n in zip(ratio, result["n"]))
    turns, closed = result["turns"], result["closed"]
    uw = result["uw"]
    undone = uw[FACTOR] * FACTOR / uw[1.0]
    gap = max(abs(turns[name] - closed[name]) for name in closed)
    return [
        Claim("§5 the sum reduction's gradient is n times the mean's",
              "‖g_sum‖/‖g_mean‖ = " + ", ".join(f"{r:.6g}" for r in ratio)
              + f" for n = {', '.join(map(str, result['n']))}", rel < 1e-5),
        Claim("§5 ... in the same direction", f"min cosine {min(cos):.8f}", min(cos) > 1 - 1e-6),
        Claim(f"§5 gradient methods feel a loss scale directly (task 1's loss × {FACTOR:g}; "
              f"the combined direction turns by more than 1°)",
              ", ".join(f"{name} {turns[name]:.1f}°" for name in METHODS)
              + f" (closed forms to {gap:.0e}°; rows {result['between']:.0f}° apart); the "
              f"Sum combine, not a gradient method, {turns['sum']:.1f}°",
              all(turns[name] > 1.0 for name in METHODS) and gap < 1e-6),
        Claim(f"§5 loss-weighting methods undo a constant scale once their weights adapt "
              f"(Uncertainty Weighting, task 1's loss × {FACTOR:g}, {UW_STEPS} Adam steps)",
              f"weight of task 1: {uw[1.0]:.4f} at scale 1, {uw[FACTOR]:.5f} at scale "
              f"{FACTOR:g}: weight × scale ratio {undone:.4f} (closed form 1)",
              abs(undone - 1) < 1e-3),
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
