"""Clip tutorial, Relatives and variants: AGC clips every unit by the ratio ‖g‖/‖w‖.

Brock et al. (2021), NFNets, eq. 3: unit i (a row of a weight: one output unit; a whole bias
vector) is rescaled to ``‖Gᵢ‖ = λ·max(‖Wᵢ‖, eps)`` when ``‖Gᵢ‖ / max(‖Wᵢ‖, eps) > λ``.
Setting: a 3-task model (MLP trunk 8→32→32, linear heads, float32, seeded), batch 32, the
library's step (:class:`~gradbalance.TaskGradBuffer`, ``Sum`` balancer) writing ``.grad``;
then :class:`gradbalance.clip.AGC` with λ = 0.25 (about the median ratio of this small net;
the paper tunes λ with the batch size, 0.01 for large batches), eps = 1e-3, the heads
excluded as the paper leaves the classifier alone.

Checked per unit, with norms taken here over each row: after AGC no ratio exceeds λ (the
clipped ones sit on λ up to float32 rounding), units at or below λ are bitwise untouched,
clipped units keep their direction.

Scale: the first trunk layer is rescaled, its weights and its gradient both multiplied by
α = 64 (a power of two, so every norm scales exactly). AGC's decision depends on the ratio
only, so the clipped gradient is exactly α times the original one and the other layers are
unchanged; global ``clip_grad_norm_`` at a fixed limit (the original total norm) changes its
factor for every layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradbalance.balancers import get_balancer
from gradbalance.clip import AGC
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "clip_agc"
TITLE = "Clip tutorial, Relatives and variants: AGC, unit-wise clipping by ‖g‖/‖w‖"
LAMBDA = 0.25
EPS = 1e-3
ALPHA = 64.0
F32 = 2.0**-24


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step has set."""
    assert p.grad is not None
    return p.grad


def model_with_grads(seed: int = 0) -> MultiTaskModel:
    """The model with ``.grad`` written by the library's step."""
    torch.manual_seed(seed)
    model = MultiTaskModel(mlp_trunk(8, 32, 2), make_heads(32, 3))
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 3, generator=gen) * 3
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    buf.backward(regression_losses(model(x), y))
    buf.apply_(get_balancer("sum"))
    return model


def linear(model: MultiTaskModel, index: int) -> nn.Linear:
    """The trunk's ``index``-th linear layer."""
    return [m for m in model.trunk.modules() if isinstance(m, nn.Linear)][index]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Units as rows: ``[out, rest]`` for a weight, one row for a bias."""
    return t.detach().reshape(t.shape[0], -1) if t.dim() > 1 else t.detach().reshape(1, -1)


def _agc(model: MultiTaskModel) -> list[torch.Tensor]:
    AGC(clip_factor=LAMBDA, eps=EPS, exclude=model.head_parameters())(model.parameters())
    return [_grad(p).detach().clone() for p in model.trunk.parameters()]


def compute(quick: bool = False) -> dict[str, Any]:
    model = model_with_grads()
    before = [_grad(p).detach().clone() for p in model.trunk.parameters()]
    heads_before = [_grad(p).detach().clone() for p in model.head_parameters()]
    after = _agc(model)
    units: list[dict[str, float]] = []
    untouched, turned = True, 0.0
    for p, g0, g1 in zip(model.trunk.parameters(), before, after):
        w, r0, r1 = _rows(p).double(), _rows(g0).double(), _rows(g1).double()
        wn = w.norm(dim=1).clamp(min=EPS)
        for i in range(w.shape[0]):
            ratio0, ratio1 = float(r0[i].norm() / wn[i]), float(r1[i].norm() / wn[i])
            units.append({"w": float(w[i].norm()), "g0": float(r0[i].norm()),
                          "g1": float(r1[i].norm()), "ratio0": ratio0, "ratio1": ratio1})
            if ratio0 <= LAMBDA:
                untouched = untouched and bool(torch.equal(r0[i], r1[i]))
            elif r0[i].norm() > 0:
                cos = float(r0[i] @ r1[i] / (r0[i].norm() * r1[i].norm()))
                turned = max(turned, 1.0 - cos)
    heads_same = all(torch.equal(a, _grad(p)) for a, p in zip(heads_before,
                                                              model.head_parameters()))

    # the rescaled layer: W₀ and G₀ of the first trunk layer times α
    scaled = model_with_grads()
    layer = linear(scaled, 0).weight
    with torch.no_grad():
        layer.mul_(ALPHA)
    _grad(layer).mul_(ALPHA)
    after_scaled = _agc(scaled)
    agc_first = bool(torch.equal(after_scaled[0], after[0] * ALPHA))
    agc_rest = all(torch.equal(a, b) for a, b in zip(after_scaled[1:], after[1:]))

    plain, rescaled = model_with_grads(), model_with_grads()
    _grad(linear(rescaled, 0).weight).mul_(ALPHA)
    limit = float(torch.cat([_grad(p).reshape(-1) for p in plain.parameters()]).norm())
    factors = []
    for m in (plain, rescaled):
        others = _grad(linear(m, 1).weight).detach().clone()
        torch.nn.utils.clip_grad_norm_(m.parameters(), limit)
        factors.append(float(_grad(linear(m, 1).weight).norm() / others.norm()))
    return {"units": units, "untouched": untouched, "turned": turned, "heads_same": heads_same,
            "agc_first": agc_first, "agc_rest": agc_rest, "global_factors": factors,
            "limit": limit}


def claims(result: dict[str, Any]) -> list[Claim]:
    units = result["units"]
    clipped = [u for u in units if u["ratio0"] > LAMBDA]
    top = max(u["ratio1"] for u in units)
    on_line = max(abs(u["ratio1"] / LAMBDA - 1) for u in clipped)
    f_plain, f_scaled = result["global_factors"]
    return [
        Claim("§Relatives and variants: AGC (Brock et al. 2021) clips per-unit by the ratio "
              "‖g‖/‖w‖",
              f"λ = {LAMBDA}: {len(clipped)} of {len(units)} trunk units above λ; after AGC "
              f"the largest ratio is {top:.7g} (clipped ones within {on_line:.1e} of λ); the "
              f"others bitwise untouched: {result['untouched']}; direction kept (1 − cos ≤ "
              f"{result['turned']:.1e}); heads excluded and untouched: {result['heads_same']}",
              top <= LAMBDA * (1 + 4 * F32) and on_line <= 4 * F32 and result["untouched"]
              and result["turned"] <= 4 * F32 and result["heads_same"] and len(clipped) > 0),
        Claim("§Relatives and variants: ... removing the global scale sensitivity",
              f"first layer's W and G × {ALPHA:g}: AGC's clipped gradient of that layer is "
              f"exactly {ALPHA:g}× the original: {result['agc_first']}, other layers "
              f"bitwise unchanged: {result['agc_rest']}; global clip_grad_norm_ at "
              f"{result['limit']:.4g} scales the second layer by {f_plain:.4g} before, "
              f"{f_scaled:.4g} after",
              result["agc_first"] and result["agc_rest"] and f_scaled < f_plain),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 5))
    units = [u for u in result["units"] if u["g0"] > 0]
    ws = [max(u["w"], EPS) for u in units]
    ax.scatter(ws, [u["g0"] for u in units], s=14, color="lightgrey",
               label="unit before AGC (‖Gᵢ‖)")
    ax.scatter(ws, [u["g1"] for u in units], s=10, color="C0", label="unit after AGC")
    line = [min(ws) * 0.8, max(ws) * 1.2]
    ax.plot(line, [LAMBDA * v for v in line], color="C3", ls="--",
            label=f"‖Gᵢ‖ = λ·‖Wᵢ‖ (λ = {LAMBDA})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("unit weight norm ‖Wᵢ‖ (a row of a weight, or a bias)")
    ax.set_ylabel("unit gradient norm ‖Gᵢ‖")
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title("trunk units: those above the line are brought onto it", fontsize=10)
    fig.suptitle(TITLE, fontsize=9)
    save_figure(fig, path)
