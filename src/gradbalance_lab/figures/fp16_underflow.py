"""§11 Loss scaling: small float16 gradients round to zero unless the loss is scaled.

Setting: float16 arithmetic on the CPU (PyTorch runs float16 matrix products and their
backward there, so nothing is emulated). A shared linear layer ``Linear(8, 8)`` (float32
master weights, used in float16 as mixed precision does) feeds two linear heads; a batch
of 64. Task 1 is a plain mean-squared error; task 2 the same loss times 1e-6, a task whose
gradient sits below float16's smallest subnormal, 2⁻²⁴ ≈ 6e-8. Each task's gradient over
the shared weights (the text's rows of ``G``) is taken through the float16 forward pass,
with the losses computed in float32 as autocast does, once unscaled and once multiplied by
``torch.amp.GradScaler("cpu")``'s scale ``s = 2¹⁶`` and divided by ``s`` afterwards (the
text's ``sizes = G.norm(dim=1) / s``). The reference is the same gradient in float64.

Pass rule, fixed before measuring: the claim holds when, unscaled, task 2's gradient has
rounded to zero in most entries (over half) while, scaled, no entry is zero and its size is
within 1 % of the float64 reference; task 1, far above the limit, is within 1 % both ways.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gradbalance_lab.figures._common import Claim, pyplot, save_figure

NAME = "fp16_underflow"
TITLE = "§11 Loss scaling against float16 underflow (float16 on the CPU)"
SMALL = 1e-6
TINY = 2.0**-24  # float16's smallest subnormal


def _rows(dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Task gradients ``[2, P]`` over the shared weights, through a ``dtype`` forward, each
    loss times ``scale`` and the rows divided by it (float64)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    y = torch.randn(64, 2, generator=gen)
    shared = torch.nn.Parameter(torch.randn(8, 8, generator=gen) * 0.3)
    heads = torch.randn(2, 8, generator=gen) * 0.3
    feats = torch.tanh(x.to(dtype) @ shared.to(dtype))
    preds = (feats @ heads.to(dtype).T).float()  # losses in float32, as autocast computes them
    losses = ((preds - y) ** 2).mean(dim=0) * torch.tensor([1.0, SMALL])
    rows = [torch.autograd.grad(loss * scale, shared, retain_graph=True)[0].reshape(-1)
            for loss in losses]
    return torch.stack(rows).double() / scale


def compute(quick: bool = False) -> dict[str, Any]:
    scale = float(torch.amp.GradScaler("cpu").get_scale())
    reference = _rows(torch.float64, 1.0)
    result: dict[str, Any] = {"scale": scale, "reference": reference.norm(dim=1).tolist(),
                              "entries": reference.abs()[1].tolist()}
    for key, s in (("unscaled", 1.0), ("scaled", scale)):
        rows = _rows(torch.float16, s)
        result[key] = {
            "sizes": rows.norm(dim=1).tolist(),
            "zero_share": (rows == 0).double().mean(dim=1).tolist(),
            "error": ((rows - reference).norm(dim=1) / reference.norm(dim=1)).tolist(),
        }
    return result


def claims(result: dict[str, Any]) -> list[Claim]:
    off, on, ref = result["unscaled"], result["scaled"], result["reference"]
    return [
        Claim("§11 to stop small gradients rounding to zero, mixed precision multiplies every "
              "loss by one scale s (float16, a task 1e-6 times smaller)",
              f"task 2 unscaled: {100 * off['zero_share'][1]:.0f}% of entries 0, size "
              f"{off['sizes'][1]:.3g} vs float64 {ref[1]:.3g}; scaled by s = "
              f"{result['scale']:g}: {100 * on['zero_share'][1]:.0f}% 0, error "
              f"{100 * on['error'][1]:.2f}%; task 1 error {100 * off['error'][0]:.2f}% / "
              f"{100 * on['error'][0]:.2f}%",
              off["zero_share"][1] > 0.5 and on["zero_share"][1] == 0.0
              and on["error"][1] < 0.01 and max(off["error"][0], on["error"][0]) < 0.01),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    entries = sorted(result["entries"])
    ax.hist(entries, bins=[10 ** (k / 4) for k in range(-48, -20)], color="C0", alpha=0.7,
            label="task 2's gradient entries (float64)")
    ax.axvline(TINY, color="C3", ls="--", label="float16 smallest subnormal 2⁻²⁴")
    ax.axvline(TINY / result["scale"], color="C2", ls=":",
               label=f"the same limit with loss scale s = {result['scale']:g}")
    ax.set_xscale("log")
    ax.set_xlabel("|gradient entry|")
    ax.set_ylabel("entries")
    off, on = result["unscaled"], result["scaled"]
    ax.set_title(f"unscaled: {100 * off['zero_share'][1]:.0f}% round to 0; scaled: "
                 f"{100 * on['zero_share'][1]:.0f}%", fontsize=10)
    ax.legend(fontsize=8)
    fig.suptitle(TITLE, fontsize=10)
    save_figure(fig, path)
