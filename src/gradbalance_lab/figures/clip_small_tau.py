"""Clip tutorial, Relatives and variants: the c → 0 limit — normalised SGD and signSGD.

Setting (float64): a 3-task model (MLP trunk 8→16→16, linear heads, seeded) at its initial
weights; the library's step (:class:`~gradbalance.TaskGradBuffer`, ``Sum`` balancer) writes
the gradient g of 20 batches of 32 (5 with ``--quick``). For limits c from 1e3 down to 1e-7
(on the first batch's g):

* norm clipping (``clip_grad_norm_(c)``) gives ``u = g·min(1, c/(‖g‖ + ε))``: g itself while
  c ≥ ‖g‖ + ε, then the normalised gradient ``c·g/‖g‖`` (normalised SGD's step), up to
  ε/‖g‖; the direction is g's all the way;
* value clipping (``clip_grad_value_(c)``) gives ``c·sign(g)`` (signSGD's step) once c is
  below the smallest nonzero |gᵢ| (exactly, in floating point: the clamp returns ±c).

Below the smallest ‖g‖ every batch's update has length c whatever its ‖g‖: direction-only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, angle_deg, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "clip_small_tau"
TITLE = "Clip tutorial, Relatives and variants: c → 0 gives normalised SGD and signSGD"
EPS = 1e-6
F64 = 2.0**-53


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step has set."""
    assert p.grad is not None
    return p.grad


def gradients(batches: int, seed: int = 0) -> list[torch.Tensor]:
    """The step's gradient (flattened) of each batch, at the initial weights."""
    torch.manual_seed(seed)
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, 3)).double()
    gen = torch.Generator().manual_seed(seed)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    out = []
    for _ in range(batches):
        x = torch.randn(32, 8, generator=gen, dtype=torch.float64)
        y = torch.randn(32, 3, generator=gen, dtype=torch.float64) * 3
        model.zero_grad(set_to_none=True)
        buf.backward(regression_losses(model(x), y))
        buf.apply_(get_balancer("sum"))
        out.append(torch.cat([_grad(p).reshape(-1) for p in model.parameters()]).clone())
    return out


def _clip(g: torch.Tensor, c: float, how: str) -> torch.Tensor:
    w = torch.nn.Parameter(torch.zeros_like(g))
    w.grad = g.clone()
    if how == "norm":
        torch.nn.utils.clip_grad_norm_([w], c)
    else:
        torch.nn.utils.clip_grad_value_([w], c)
    return w.grad


def compute(quick: bool = False) -> dict[str, Any]:
    grads = gradients(5 if quick else 20)
    cs = [10.0**k for k in range(3, -8, -1)] if quick else \
        torch.logspace(3, -7, 51, dtype=torch.float64).tolist()
    g0 = grads[0]
    curves: dict[str, list[float]] = {"to_raw": [], "to_normalised": [], "to_sign": [],
                                      "angle": [], "length_gap": []}
    for c in cs:
        u = _clip(g0, c, "norm")
        curves["to_raw"].append(float((u - g0).norm() / g0.norm()))
        curves["to_normalised"].append(float((u / c - g0 / g0.norm()).norm()))
        curves["angle"].append(angle_deg(u, g0))
        want = min(c, float(g0.norm()))
        curves["length_gap"].append(abs(float(u.norm()) - want) / want)
        v = _clip(g0, c, "value")
        sign = g0.sign()
        curves["to_sign"].append(float((v / c - sign).norm() / sign.norm()))
    sizes = [float(g.norm()) for g in grads]
    small = min(sizes) / 1000
    lengths = [float(_clip(g, small, "norm").norm()) for g in grads]
    smallest_entry = float(g0.abs()[g0 != 0].min())
    tiny = smallest_entry / 2
    signed = _clip(g0, tiny, "value") / tiny
    return {"c": cs, **curves, "norm_g": float(g0.norm()), "sizes": sizes, "small_c": small,
            "lengths": lengths, "smallest_entry": smallest_entry, "tiny_c": tiny,
            "sign_exact": bool(torch.equal(signed, g0.sign())), "entries": g0.numel(),
            "zeros": int((g0 == 0).sum())}


def claims(result: dict[str, Any]) -> list[Claim]:
    cs, n = result["c"], result["norm_g"]
    above = [r for c, r in zip(cs, result["to_raw"]) if c >= n + EPS]
    below = [d for c, d in zip(cs, result["to_normalised"]) if c < n]
    lengths, small = result["lengths"], result["small_c"]
    spread = max(abs(v / small - 1) for v in lengths)
    bound = EPS / min(result["sizes"]) + 16 * F64
    return [
        Claim("§Relatives and variants: normalised SGD (and signSGD, next row) are the c → 0 "
              "limit family — direction-only updates",
              f"below ‖g‖ = {n:.4g}: ‖u/c − g/‖g‖‖ ≤ {max(below):.1e} (ε/‖g‖ = "
              f"{EPS / n:.1e}); at c = {small:.2g} the {len(lengths)} batches' updates all "
              f"have length c within {spread:.1e} while ‖g‖ spans {min(result['sizes']):.3g}"
              f" … {max(result['sizes']):.3g}",
              max(below) <= EPS / n + 16 * F64 and spread <= bound),
        Claim("§Relatives and variants: signSGD is the same limit of per-value clipping",
              f"clip_grad_value_ at c = {result['tiny_c']:.2g} (half the smallest nonzero "
              f"|gᵢ|): u/c equals sign(g) on all {result['entries']} entries "
              f"({result['zeros']} zero): {result['sign_exact']}",
              result["sign_exact"]),
        Claim("§Relatives and variants: clipping interpolates between raw and normalised "
              "gradients",
              f"c ≥ ‖g‖ + ε: u = g ({len(above)} limits, largest gap {max(above):.1e}); over "
              f"all {len(cs)} limits the direction is g's (≤ {max(result['angle']):.1e}°) and "
              f"‖u‖ = min(c, ‖g‖) within {max(result['length_gap']):.1e}",
              max(above) == 0.0 and max(result["angle"]) < 1e-5
              and max(result["length_gap"]) <= EPS / n + 16 * F64),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 4.5))
    floor = 1e-17  # exact zeros drawn at the floor of the log axis
    cs = result["c"]
    for key, color, label in (
            ("to_raw", "C0", "norm clip: ‖u − g‖/‖g‖ (distance to the raw gradient)"),
            ("to_normalised", "C3", "norm clip: ‖u/c − g/‖g‖‖ (to normalised SGD)"),
            ("to_sign", "C2", "value clip: ‖u/c − sign g‖/‖sign g‖ (to signSGD)")):
        ax.plot(cs, [max(v, floor) for v in result[key]], "o-", ms=3, color=color,
                label=label)
    ax.axvline(result["norm_g"], color="grey", ls=":", label=f"c = ‖g‖ = {result['norm_g']:.3g}")
    ax.axvline(result["smallest_entry"], color="C2", ls=":",
               label=f"c = smallest nonzero |gᵢ| = {result['smallest_entry']:.2g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(floor / 3, 30)
    ax.set_xlabel("clip limit c")
    ax.set_ylabel(f"distance (exact zeros drawn at {floor:g})")
    ax.axhline(EPS / result["norm_g"], color="C3", lw=0.8, ls="--",
               label=f"ε/‖g‖ = {EPS / result['norm_g']:.1e} (the ε of the formula)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("large c: the raw gradient; small c: normalised / sign updates", fontsize=10)
    fig.suptitle(TITLE, fontsize=9)
    save_figure(fig, path)
