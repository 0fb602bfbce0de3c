"""Clip tutorial, Relatives and variants: per-sample clipping in DP-SGD (Abadi et al. 2016).

Each sample's gradient is clipped on its own before the batch mean,
``ĝ = (1/B) Σᵢ min(1, C/(‖gᵢ‖ + ε)) gᵢ``, then Gaussian noise of standard deviation σC is added
to the clipped sum (σC/B on the mean). Setting (float64): a 2-task model (MLP trunk 8→16,
linear heads, seeded), B = 16 samples, C = 5 (below about two thirds of the 16 norms), the
whole-sample clip (``per_task=False``: each sample's gradient of its summed task losses),
σ = 1.

* The library: :class:`gradbalance.clip.PerSampleClip` turns the ``[B, 2]`` per-sample losses
  into task losses; the step (:class:`~gradbalance.TaskGradBuffer`, ``Sum`` balancer) writes
  ``ĝ`` into ``.grad``. The loop here: one backward per sample, clip, mean. The per-sample
  norms also come from the model (``losses_of_model``, through ``torch.func``) and as ghost
  norms (:class:`gradbalance.clip.GhostNorms`).
* Noise: ``PerSampleClip.add_noise_`` 200 times (20 with ``--quick``) on the same ``ĝ``; the
  sample standard deviation of the added values against σC/B (3 standard errors of a
  Gaussian's sample deviation, ``3/√(2N)`` relative, over N values).
* Sensitivity: sample 0 replaced by an outlier (its input and targets × 1000). The clipped sum
  ``B·ĝ`` moves by at most 2C (each sample contributes at most C), the plain sum by far more.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from gradbalance.balancers import get_balancer
from gradbalance.clip import GhostNorms, PerSampleClip
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk

NAME = "clip_per_sample"
TITLE = "Clip tutorial, Relatives and variants: per-sample clipping (DP-SGD)"
C = 5.0
SIGMA = 1.0
B = 16
EPS = 1e-6


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step has set."""
    assert p.grad is not None
    return p.grad


def setup(seed: int = 0) -> tuple[MultiTaskModel, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = MultiTaskModel(mlp_trunk(8, 16, 1), make_heads(16, 2)).double()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(B, 2, generator=gen, dtype=torch.float64) * 2
    return model, x, y


def per_sample_losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``[B, 2]``: squared error of each sample on each task."""
    out = torch.cat(model(x), dim=1)
    return (out - y) ** 2


def _params(model: MultiTaskModel) -> list[torch.Tensor]:
    return [*model.shared_parameters(), *model.head_parameters()]


def _flat(model: MultiTaskModel) -> torch.Tensor:
    return torch.cat([_grad(p).reshape(-1) for p in _params(model)]).clone()


def library_step(model: MultiTaskModel, x: torch.Tensor, y: torch.Tensor,
                 clip: PerSampleClip | None) -> torch.Tensor:
    """``.grad`` written by the step from the per-sample-clipped (or plain mean) losses."""
    model.zero_grad(set_to_none=True)
    losses = per_sample_losses(model, x, y)
    task_losses = clip(losses, _params(model)) if clip is not None else losses.mean(dim=0)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    buf.backward(task_losses)
    buf.apply_(get_balancer("sum"))
    return _flat(model)


def loop(model: MultiTaskModel, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor,
                                                                         list[float]]:
    """The per-sample loop: one backward per sample, clip at C, mean."""
    total, norms = None, []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(per_sample_losses(model, x[i:i + 1], y[i:i + 1]).sum(),
                                    _params(model))
        g = torch.cat([t.reshape(-1) for t in grads])
        norm = float(g.norm())
        norms.append(norm)
        g = g * min(1.0, C / (norm + EPS))
        total = g if total is None else total + g
    assert total is not None
    return total / x.shape[0], norms


def compute(quick: bool = False) -> dict[str, Any]:
    model, x, y = setup()
    clip = PerSampleClip(C, per_task=False, noise_multiplier=SIGMA,
                         generator=torch.Generator().manual_seed(0))
    clipped = library_step(model, x, y, clip)
    assert clip.last_norms is not None
    lib_norms = clip.last_norms.tolist()
    lib_after = (clip.factors(clip.last_norms) * clip.last_norms).tolist()
    reference, loop_norms = loop(model, x, y)

    func = PerSampleClip(C, per_task=False)
    func.losses_of_model(model, lambda out, t: (torch.cat(out, dim=1) - t) ** 2, x, y,
                         params=_params(model))
    assert func.last_norms is not None
    func_norms = func.last_norms.tolist()
    ghost = GhostNorms(model, per_task=False)
    ghost_norms = ghost.norms(per_sample_losses(model, x, y))
    ghost.remove()

    draws = 20 if quick else 200
    noise = []
    params = _params(model)
    for _ in range(draws):
        offset = 0
        for p in params:
            p.grad = clipped[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        clip.add_noise_(params, batch_size=B)
        noise.append(_flat(model) - clipped)
    values = torch.cat(noise)

    x2, y2 = x.clone(), y.clone()
    x2[0] *= 1000.0
    y2[0] *= 1000.0
    clipped2 = library_step(model, x2, y2, PerSampleClip(C, per_task=False))
    plain = library_step(model, x, y, None)
    plain2 = library_step(model, x2, y2, None)
    return {
        "gap": float((clipped - reference).norm() / reference.norm()),
        "norms": loop_norms, "lib_after": lib_after,
        "lib_norm_gap": max(abs(a - b) for a, b in zip(lib_norms, loop_norms)),
        "func_norm_gap": max(abs(a - b) for a, b in zip(func_norms, loop_norms)),
        "ghost_norm_gap": max(abs(a - b) for a, b in zip(ghost_norms.tolist(), loop_norms)),
        "noise_std": float(values.std()), "noise_mean": float(values.mean()),
        "noise_n": values.numel(), "noise_sample": values[:4000].tolist(),
        "expected_std": SIGMA * C / B,
        "sens_clipped": float((clipped2 - clipped).norm() * B),
        "sens_plain": float((plain2 - plain).norm() * B),
    }


def claims(result: dict[str, Any]) -> list[Claim]:
    norms = result["norms"]
    n_clipped = sum(v > C for v in norms)
    std, want, n = result["noise_std"], result["expected_std"], result["noise_n"]
    rel = 3 / math.sqrt(2 * n)  # 3 standard errors of a Gaussian sample deviation
    mean_tol = 3 * want / math.sqrt(n)
    norm_gap = max(result["lib_norm_gap"], result["func_norm_gap"], result["ghost_norm_gap"])
    return [
        Claim("§Relatives and variants: per-sample clipping in DP-SGD — each sample's gradient "
              "clipped individually before aggregation",
              f"B = {B}, C = {C:g}: {n_clipped} samples clipped (norms "
              f"{min(norms):.3g} … {max(norms):.3g}); PerSampleClip + the step vs the "
              f"per-sample loop: {result['gap']:.1e} (relative); per-sample norms from the "
              f"graph / torch.func / ghost norms vs the loop: within {norm_gap:.1e}",
              result["gap"] < 1e-12 and norm_gap < 1e-12 * max(norms) and 0 < n_clipped < B),
        Claim("§Relatives and variants: DP-SGD adds Gaussian noise to the clipped aggregate "
              "(σC on the sum, σC/B on the mean)",
              f"add_noise_ (σ = {SIGMA:g}), {n} values: standard deviation {std:.5f} vs "
              f"σC/B = {want:.5f} (±{100 * rel:.1f}%); mean {result['noise_mean']:.1e}",
              abs(std / want - 1) <= rel and abs(result["noise_mean"]) <= mean_tol),
        Claim("§Relatives and variants: there the clip bounds sensitivity for the privacy "
              "accountant",
              f"one sample replaced by an outlier (× 1000): the clipped sum moves by "
              f"{result['sens_clipped']:.4g} (≤ 2C = {2 * C:g}); the unclipped sum by "
              f"{result['sens_plain']:.4g}",
              result["sens_clipped"] <= 2 * C * (1 + 1e-12)
              and result["sens_plain"] > 2 * C),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    norms = result["norms"]
    ax1.bar(range(len(norms)), norms, color="lightgrey", label="‖gᵢ‖ before clipping")
    ax1.bar(range(len(norms)), result["lib_after"], color="C0",
            label="after PerSampleClip (factor × norm)")
    ax1.axhline(C, color="C3", ls="--", label=f"C = {C:g}")
    ax1.set_xlabel("sample i")
    ax1.set_ylabel("per-sample gradient norm")
    ax1.legend(fontsize=8, loc="upper right")
    ax1.set_title("each sample clipped on its own")
    values, std = result["noise_sample"], result["expected_std"]
    ax2.hist(values, bins=40, density=True, color="C0", alpha=0.6,
             label=f"noise added by add_noise_ ({len(values)} values)")
    grid = [std * (-4 + 8 * i / 200) for i in range(201)]
    ax2.plot(grid, [math.exp(-0.5 * (v / std) ** 2) / (std * math.sqrt(2 * math.pi))
                    for v in grid], color="C3", label=f"N(0, (σC/B)²), σC/B = {std:g}")
    ax2.set_xlabel("noise on one gradient entry")
    ax2.set_ylabel("density")
    ax2.legend(fontsize=8, loc="upper right")
    ax2.set_title("Gaussian noise on the clipped mean")
    fig.suptitle(TITLE)
    save_figure(fig, path)
