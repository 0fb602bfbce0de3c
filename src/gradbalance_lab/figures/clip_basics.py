"""Clip tutorial, How it works and Definitions: ``g ← g · min(1, c / (‖g‖₂ + ε))``.

Setting: one float32 parameter of two weights whose gradient the library's step writes
(:func:`~gradbalance.balanced_backward` with the ``Sum`` balancer and the one task loss
``w · v``, so ``.grad = v``): ``v = (1.8, 2.4)`` (size 3) and ``v = (150, 200)`` (size 250).
Each is clipped at the text's limit c = 10 by ``torch.nn.utils.clip_grad_norm_`` and, as one
row of ``G``, by the library's kernel :func:`gradbalance.functional.clip_task_norms_`.

ε is read off a float64 clip: a gradient of size 1 clipped at c = 0.5 is multiplied by
``f = c / (1 + ε)``, so ``ε = c / f − 1`` (float64 rounding: about 1e-16). A zero gradient
clipped at c = 10 shows what ε guards against (0/0). Tolerances: the size-250 gradient ends at
``10 · 250 / (250 + ε)``, 4e-8 below 10, plus float32 rounding (2 units in the last place of
10, 2⁻²⁰ each); the factor 25 is off by the same ε/250 and one float32 rounding per entry.

The plot sweeps sizes from 0.1 to 1000 (float32 gradients ``(0.6, 0.8) · size``) at c = 10:
the post-clip size against the pre-clip size, for torch and for the library's kernel.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.functional import clip_task_norms_
from gradbalance.step import balanced_backward
from gradbalance_lab.figures._common import Claim, angle_deg, pyplot, save_figure

NAME = "clip_basics"
TITLE = "Clip tutorial, How it works: size 3 untouched, size 250 divided by 25 (limit 10)"
LIMIT = 10.0
EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s guard, the ε of the text
F32 = 2.0**-23  # float32: one unit in the last place of a number in [1, 2)


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step has set."""
    assert p.grad is not None
    return p.grad


def ulp32(x: float) -> float:
    """One unit in the last place of ``x`` in float32."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 23)


def _grad_of(v: tuple[float, float], dtype: torch.dtype = torch.float32) -> torch.nn.Parameter:
    """A parameter whose ``.grad`` the library's step set to ``v``."""
    w = torch.nn.Parameter(torch.zeros(2, dtype=dtype))
    balanced_backward([w @ torch.tensor(v, dtype=dtype)], get_balancer("sum"), shared_params=[w])
    return w


def _clip_pair(v: tuple[float, float]) -> dict[str, Any]:
    """``v`` clipped at LIMIT by torch and by the library's row kernel."""
    w = _grad_of(v)
    before = _grad(w).detach().clone()
    returned = float(torch.nn.utils.clip_grad_norm_([w], max_norm=LIMIT))
    after = _grad(w).detach().clone()
    row = before.clone().unsqueeze(0)
    lib_returned = float(clip_task_norms_(row, LIMIT)[0])
    return {"before": before.tolist(), "after": after.tolist(), "returned": returned,
            "size_after": float(after.norm()), "size_after64": float(after.double().norm()),
            "ratio": [float(b) / float(a) for a, b in zip(after.double(), before.double())],
            "angle": angle_deg(before, after), "lib_after": row[0].tolist(),
            "lib_returned": lib_returned, "same": bool(torch.equal(row[0], after))}


def _epsilon() -> dict[str, Any]:
    """ε read off a float64 clip of a size-1 gradient at c = 0.5, torch and library."""
    w = _grad_of((0.6, 0.8), torch.float64)
    torch.nn.utils.clip_grad_norm_([w], max_norm=0.5)
    f_torch = float(_grad(w)[0]) / 0.6
    row = torch.tensor([[0.6, 0.8]], dtype=torch.float64)
    clip_task_norms_(row, 0.5)
    f_lib = float(row[0, 0]) / 0.6
    zero = torch.nn.Parameter(torch.zeros(2))
    zero.grad = torch.zeros(2)
    torch.nn.utils.clip_grad_norm_([zero], max_norm=LIMIT)
    return {"torch": 0.5 / f_torch - 1.0, "library": 0.5 / f_lib - 1.0,
            "zero_after": zero.grad.tolist()}


def compute(quick: bool = False) -> dict[str, Any]:
    sizes = torch.logspace(-1, 3, 9 if quick else 41).tolist()
    sweep_torch, sweep_lib = [], []
    for s in sizes:
        w = torch.nn.Parameter(torch.zeros(2))
        w.grad = torch.tensor([0.6, 0.8]) * s
        row = w.grad.clone().unsqueeze(0)
        torch.nn.utils.clip_grad_norm_([w], max_norm=LIMIT)
        clip_task_norms_(row, LIMIT)
        sweep_torch.append(float(w.grad.norm()))
        sweep_lib.append(float(row.norm()))
    return {"small": _clip_pair((1.8, 2.4)), "large": _clip_pair((150.0, 200.0)),
            "eps": _epsilon(), "sizes": sizes, "sweep_torch": sweep_torch,
            "sweep_lib": sweep_lib}


def _vec(v: list[float]) -> str:
    return "[" + ", ".join(f"{x:.7g}" for x in v) + "]"


def claims(result: dict[str, Any]) -> list[Claim]:
    small, large, eps = result["small"], result["large"], result["eps"]
    shift = LIMIT * EPS / 250.0  # ε moves the end size below 10 by this much
    size_tol = shift + 2 * ulp32(LIMIT)  # + 2 float32 steps at 10 (2⁻²⁰ each)
    steps = round((large["size_after"] - LIMIT) / ulp32(LIMIT))
    ratio_tol = 25.0 * (EPS / 250.0 + 2 * F32)  # ε/250 and one rounding per entry
    return [
        Claim("§How it works: gradient size 3, limit 10 → untouched",
              f"returned {small['returned']:.7g}; .grad after {_vec(small['after'])}, bitwise "
              f"equal to before: {small['after'] == small['before']}; library kernel: "
              f"{small['lib_after'] == small['before']}",
              small["after"] == small["before"] and small["lib_after"] == small["before"]
              and abs(small["returned"] - 3.0) <= ulp32(3.0)),
        Claim("§How it works: gradient size 250, limit 10 → every gradient scaled down by 25x",
              f"returned {large['returned']:.7g}; before/after per entry "
              + ", ".join(f"{r:.9g}" for r in large["ratio"])
              + f"; library kernel identical: {large['same']}",
              all(abs(r - 25.0) <= ratio_tol for r in large["ratio"]) and large["same"]
              and large["returned"] == large["lib_returned"] == 250.0),
        Claim("§How it works: direction kept, size now exactly 10",
              f"after {_vec(large['after'])}: size {large['size_after']!r} in float32 "
              f"(10 {steps:+d} float32 steps; exact norm of those entries "
              f"{large['size_after64']:.10g}); turned {large['angle']:.2g}°",
              abs(large["size_after"] - LIMIT) <= size_tol and large["angle"] < 1e-3),
        Claim("§Definitions: ε in g ← g·min(1, c/(‖g‖₂ + ε)) is a small constant against "
              "division by zero",
              f"ε = {eps['torch']:.6g} (clip_grad_norm_), {eps['library']:.6g} "
              f"(clip_task_norms_); a zero gradient clipped at 10 stays {eps['zero_after']}",
              abs(eps["torch"] - EPS) < 1e-14 and abs(eps["library"] - EPS) < 1e-14
              and eps["zero_after"] == [0.0, 0.0]),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    sizes = result["sizes"]
    ax.plot(sizes, sizes, color="lightgrey", ls=":", label="no clipping (after = before)")
    ax.plot(sizes, result["sweep_torch"], color="C0", lw=2, label="clip_grad_norm_ (torch)")
    ax.plot(sizes, result["sweep_lib"], color="C1", ls="--",
            label="clip_task_norms_ (gradbalance)")
    for key, marker in (("small", "o"), ("large", "s")):
        p = result[key]
        ax.plot([p["returned"]], [p["size_after"]], marker, color="C3", ms=8)
        ax.annotate(f"size {p['returned']:.3g} → {p['size_after']:.7g}",
                    (p["returned"], p["size_after"]), textcoords="offset points",
                    xytext=(-40, 12 if key == "small" else -22))
    ax.axhline(LIMIT, color="C3", lw=0.8, ls="--", label="limit c = 10")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("gradient size before clipping ‖g‖₂")
    ax.set_ylabel("gradient size after clipping")
    ax.legend(loc="upper left")
    ax.set_title("global norm clipping at c = 10")
    fig.suptitle(TITLE, fontsize=9)
    save_figure(fig, path)
