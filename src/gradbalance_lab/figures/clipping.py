"""§10 Gradient clipping, and the worked examples of the clip tutorial.

Exact examples: the weights ``w = (3, 4)`` with the loss ``(w · (30, 40)).sum()`` written
into ``.grad`` by the library's step (``Sum`` balancer), then PyTorch's global
``clip_grad_norm_(max_norm=1)`` (returns 50, leaves ``(0.6, 0.8)``) or
``clip_grad_value_(clip_value=5)`` (leaves ``(5, 5)``: the direction turns). Per-task
clipping: two tasks with gradients ``(30, 40)`` (norm 50) and ``(0.3, 0.4)`` (norm 0.5) go
through ``TaskGradBuffer.apply_(Sum(), clip=TaskClip(max_norm=1))``: the first row is capped
at norm 1, the second is untouched. Those two rows are parallel, so the combined update keeps
its direction; with rows that are not parallel it turns. ``(30, 40)`` and ``(−0.4, 0.3)``
(norms 50 and 0.5, 90° apart) give ``(0.6, 0.8) + (−0.4, 0.3) = (0.2, 1.1)`` against the
unclipped ``(29.6, 40.3)``: the closed form of the turn is the angle between those two sums,
and global clipping of the unclipped sum (one factor) turns it by nothing. A sweep rotates
the second row from 0° to 180° away from the first and measures the turn each time.

The percentile rule: a small 3-task MLP (8 inputs, trunk 32×2, targets scaled 1, 10, 0.1)
trained for 200 steps with Adam (lr 1e-2) and the ``Mean`` balancer, no clipping; the
pre-clip norms (``clip_grad_norm_(max_norm=inf)``) are logged and
:func:`gradbalance.clip.suggest_max_norm` picks the 95th percentile, checked against
``numpy``-style linear interpolation done here by sorting. Sweeping the limit τ from the 10th
percentile to twice the largest norm, each τ is then used in a training run of its own (the
same model and batches, seed 1, clipped globally at τ): the share of that run's steps clipped
and the mean shrink factor ``min(1, τ/‖g‖)`` are measured there, so a smaller τ is not more
clipping by construction (the clipped runs move elsewhere and meet other norms). That the
p95 limit of the logged run is exceeded by at most 5 % of the same 200 norms holds by
definition; the test on a fresh run is in the ``clip_threshold`` figure.

No default limit: ``inspect.signature`` of ``clip_grad_norm_`` (``max_norm``),
``clip_grad_value_`` (``clip_value``) and the library's ``TaskClip`` (``max_norm``) is read,
and each is called without its limit; met when no signature gives the limit a default and
each call raises a ``TypeError`` naming it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, angle_deg, pyplot, require_attr, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "clipping"
TITLE = "§10 Gradient clipping (and the clip tutorial's examples)"


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step has set."""
    assert p.grad is not None
    return p.grad


def _single_grad() -> torch.Tensor:
    """``w = (3, 4)``; the loss ``(w · (30, 40)).sum()`` through the library's step."""
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    buf = TaskGradBuffer([w])
    buf.backward(torch.stack([(w * torch.tensor([30.0, 40.0])).sum()]))
    buf.apply_(get_balancer("sum"))
    return w


TURN_ROWS = ((30.0, 40.0), (-0.4, 0.3))


def _task_clip_sum(rows: torch.Tensor) -> tuple[list[float], list[float]]:
    """``Sum`` of the rows of G after ``TaskClip(1)`` through the library's step (float64);
    returns (combined gradient, pre-clip norms)."""
    task_clip = require_attr("clip", "TaskClip")
    w = torch.nn.Parameter(torch.zeros(rows.shape[1], dtype=torch.float64))
    buf = TaskGradBuffer([w])
    buf.backward((rows * w).sum(dim=1))
    stats = buf.apply_(get_balancer("sum"), clip=task_clip(max_norm=1.0))
    assert stats.pre_clip_norms is not None
    return _grad(w).tolist(), stats.pre_clip_norms.tolist()


def _turn(rows: torch.Tensor) -> dict[str, Any]:
    """How far per-task clipping turns the summed update of ``rows``, and global clipping."""
    combined, pre = _task_clip_sum(rows)
    unclipped = rows.sum(dim=0)
    g = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    g.grad = unclipped.clone()
    torch.nn.utils.clip_grad_norm_([g], max_norm=1.0)
    scale = [min(1.0, 1.0 / (float(r.norm()) + 1e-6)) for r in rows]
    expected = (rows * torch.tensor(scale, dtype=torch.float64).unsqueeze(1)).sum(dim=0)
    return {"rows": rows.tolist(), "combined": combined, "pre": pre,
            "unclipped": unclipped.tolist(), "between": angle_deg(rows[0], rows[1]),
            "turn": angle_deg(torch.tensor(combined, dtype=torch.float64), unclipped),
            "turn_expected": angle_deg(expected, unclipped),
            "global_turn": angle_deg(g.grad, unclipped)}


def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), written out independently."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _logged_run(steps: int, seed: int = 0, tau: float = math.inf) -> list[float]:
    """Pre-clip norms of a run of a small 3-task model, clipped globally at ``tau``
    (default: unclipped)."""
    torch.manual_seed(seed)
    x = torch.randn(512, 8)
    targets = torch.stack([(x @ torch.randn(8)) * s for s in (1.0, 10.0, 0.1)], dim=1)
    model = MultiTaskModel(mlp_trunk(8, 32, 2), make_heads(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer("mean")
    gen = torch.Generator().manual_seed(seed)
    norms = []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        buf.backward(regression_losses(model(x[idx]), targets[idx]))
        buf.apply_(balancer)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), tau)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _no_default() -> dict[str, dict[str, Any]]:
    """The limit of ``clip_grad_norm_``, ``clip_grad_value_`` and the library's ``TaskClip``:
    whether the signature gives it a default, and the error of a call without it."""
    out = {}
    limits: tuple[tuple[str, Callable[..., Any], str], ...] = (
        ("clip_grad_norm_", torch.nn.utils.clip_grad_norm_, "max_norm"),
        ("clip_grad_value_", torch.nn.utils.clip_grad_value_, "clip_value"),
        ("TaskClip", require_attr("clip", "TaskClip"), "max_norm"))
    for name, fn, arg in limits:
        w = torch.nn.Parameter(torch.ones(2))
        w.grad = torch.ones(2)
        try:
            fn() if name == "TaskClip" else fn([w])
            error = ""
        except TypeError as exc:
            error = str(exc)
        out[name] = {"arg": arg, "error": error,
                     "required": inspect.signature(fn).parameters[arg].default
                     is inspect.Parameter.empty}
    return out


def compute(quick: bool = False) -> dict[str, Any]:
    result: dict[str, Any] = {"no_default": _no_default()}
    w = _single_grad()
    result["grad"] = _grad(w).tolist()
    result["returned"] = float(torch.nn.utils.clip_grad_norm_([w], max_norm=1.0))
    result["global"] = _grad(w).tolist()
    result["global_norm"] = float(_grad(w).norm())
    result["global_angle"] = angle_deg(_grad(w), torch.tensor([30.0, 40.0]))
    w = _single_grad()
    torch.nn.utils.clip_grad_value_([w], clip_value=5.0)
    result["value"] = _grad(w).tolist()
    result["value_angle"] = angle_deg(_grad(w), torch.tensor([30.0, 40.0]))

    task_clip = require_attr("clip", "TaskClip")
    suggest = require_attr("clip", "suggest_max_norm")
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    rows = torch.tensor([[30.0, 40.0], [0.3, 0.4]], dtype=torch.float64)
    buf = TaskGradBuffer([w])
    buf.backward((rows * w).sum(dim=1))
    stats = buf.apply_(get_balancer("sum"), clip=task_clip(max_norm=1.0))
    assert stats.pre_clip_norms is not None and stats.task_norms is not None
    result["task_pre_clip"] = stats.pre_clip_norms.tolist()
    result["task_grad"] = _grad(w).tolist()
    result["task_post_norms"] = stats.task_norms.tolist()
    result["turn"] = _turn(torch.tensor(TURN_ROWS, dtype=torch.float64))
    sweep_deg = list(range(0, 181, 30 if quick else 5))
    base = torch.tensor(TURN_ROWS[0], dtype=torch.float64)
    turns = []
    for deg in sweep_deg:
        rot = torch.tensor([[math.cos(math.radians(deg)), -math.sin(math.radians(deg))],
                            [math.sin(math.radians(deg)), math.cos(math.radians(deg))]],
                           dtype=torch.float64)
        turns.append(_turn(torch.stack([base, rot @ base / 100]))["turn"])
    result["sweep_between"], result["sweep_turn"] = sweep_deg, turns

    norms = _logged_run(200)
    result["norms"] = norms
    result["suggested"] = float(suggest(norms, percentile=95))
    result["reference_p95"] = _percentile(norms, 95)
    taus = [_percentile(norms, q) for q in (10, 50, 90, 95)] + [2 * max(norms)]
    result["sweep_tau"] = taus
    clipped = [_logged_run(200, seed=1, tau=t) for t in taus]
    result["sweep_share"] = [sum(n > t for n in run) / len(run) for t, run in zip(taus, clipped)]
    result["sweep_factor"] = [sum(min(1.0, t / n) for n in run) / len(run)
                              for t, run in zip(taus, clipped)]
    return result


def claims(result: dict[str, Any]) -> list[Claim]:
    g, v = result["global"], result["value"]
    rows = result["task_grad"]
    pre = result["task_pre_clip"]
    share = result["sweep_share"]
    factor = result["sweep_factor"]
    expected_row = [0.6 * 50 / (50 + 1e-6) + 0.3, 0.8 * 50 / (50 + 1e-6) + 0.4]
    turn, sweep = result["turn"], result["sweep_turn"]
    return [
        Claim("clip tutorial §Watching a clip happen: global clip of [30, 40] at max_norm 1 "
              "returns 50",
              f"{result['returned']:.6g}", result["returned"] == 50.0),
        Claim("clip tutorial §Watching a clip happen: ... and leaves [0.6, 0.8]: same "
              "direction, length 1 (0.99999994 in float32)",
              f"[{g[0]:.7g}, {g[1]:.7g}], length {result['global_norm']:.8g}, "
              f"turned {result['global_angle']:.2g}°",
              abs(g[0] - 0.6) < 1e-6 and abs(g[1] - 0.8) < 1e-6 and result["global_angle"] < 1e-3),
        Claim("§10 (and clip tutorial §The walkthrough): per-value clip at 5 gives [5, 5]: the "
              "direction turns",
              f"[{v[0]:.6g}, {v[1]:.6g}], turned {result['value_angle']:.1f}°",
              v == [5.0, 5.0] and result["value_angle"] > 5),
        Claim("§10: per-task clipping caps each row of G before the combine (τ = 1: parallel "
              "rows of norm 50 and 0.5)",
              f"pre-clip norms {pre[0]:.4g}, {pre[1]:.4g}; combined [{rows[0]:.6f}, "
              f"{rows[1]:.6f}] (expected [0.9, 1.2])",
              abs(rows[0] - expected_row[0]) < 1e-9 and abs(rows[1] - expected_row[1]) < 1e-9
              and abs(pre[0] - 50) < 1e-9 and abs(pre[1] - 0.5) < 1e-9),
        Claim("clip tutorial §Try it yourself (check): suggest_max_norm of a logged unclipped "
              "run (200 steps) is its 95th percentile",
              f"suggest_max_norm = {result['suggested']:.4g}, percentile by sorting "
              f"{result['reference_p95']:.4g} (that at most 5% of the same norms lie above it "
              f"holds by definition; the fresh-run test is the clip_threshold figure)",
              abs(result["suggested"] - result["reference_p95"]) < 1e-9 * result["suggested"]),
        Claim("§10: a smaller τ clips more steps and shortens them more; a very large τ never "
              "clips (one training run clipped at each τ)",
              "share of the run's steps clipped at τ = p10/p50/p90/p95/2·max of the logged "
              "run: " + ", ".join(f"{100 * s:.0f}%" for s in share)
              + "; mean factor min(1, τ/‖g‖) " + ", ".join(f"{f:.2f}" for f in factor),
              all(a > b for a, b in pairwise(share[:-1]))
              and all(a < b for a, b in pairwise(factor[:-1]))
              and share[-1] == 0.0 and factor[-1] == 1.0),
        Claim("§10: only the global clip scales the whole gradient by one factor — per-task "
              "clipping of rows that are not parallel turns the update",
              f"rows [30, 40] and [-0.4, 0.3] ({turn['between']:.0f}° apart, norms "
              f"{turn['pre'][0]:.4g}, {turn['pre'][1]:.4g}): combined "
              f"[{turn['combined'][0]:.6f}, {turn['combined'][1]:.6f}] vs unclipped "
              f"[{turn['unclipped'][0]:.4g}, {turn['unclipped'][1]:.4g}]: turned "
              f"{turn['turn']:.4f}° (closed form {turn['turn_expected']:.4f}°); global clip of "
              f"the sum turned {turn['global_turn']:.1g}°; over the sweep of the angle "
              f"between the rows, largest turn {max(sweep):.2f}° at "
              f"{result['sweep_between'][sweep.index(max(sweep))]}°, "
              f"{sweep[0]:.1g}° when parallel",
              abs(turn["turn"] - turn["turn_expected"]) < 1e-6 and turn["turn"] > 1.0
              and turn["global_turn"] < 1e-6 and sweep[0] < 1e-6),
        Claim("§10: PyTorch has no default limit; it is set per model",
              "; ".join(f"{k}: {v['arg']} required in the signature {v['required']}, a call "
                        f"without it raises TypeError naming it {v['arg'] in v['error']}"
                        for k, v in result["no_default"].items()),
              all(v["required"] and v["arg"] in v["error"]
                  for v in result["no_default"].values())),
    ]


def _vector_axes(ax: Any, xlim: tuple[float, float], ylim: tuple[float, float], where: str,
                 title: str) -> None:
    """Equal-aspect gradient axes with their limits, labels, legend and title."""
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.set_aspect("equal")
    ax.legend(loc=where, fontsize=8)
    ax.set_xlabel("gradient, weight 1")
    ax.set_ylabel("gradient, weight 2")
    ax.set_title(title, fontsize=10)


def _plot_examples(ax: Any, result: dict[str, Any]) -> None:
    """Top left, at true scale: the clipped vectors, and the direction of ``[30, 40]`` as a
    dashed ray (its length, 50, is off the axes)."""
    gx, gy = result["grad"]
    reach = 7.0 / max(gx, gy)
    ax.plot([0, gx * reach], [0, gy * reach], color="grey", ls="--", lw=1.2,
            label="direction of [30, 40] (length 50, off the axes)")
    for vec, label, color in ((result["value"], "value clip (5): [5, 5]", "C3"),
                              (result["global"], "global clip (τ = 1): [0.6, 0.8]", "C0")):
        ax.quiver(0.0, 0.0, *vec, angles="xy", scale_units="xy", scale=1, color=color,
                  label=label, width=0.012, zorder=3)
    _vector_axes(ax, (-0.3, 6.5), (-0.3, 6.5), "upper left",
                 "true scale: norm clip keeps the direction, value clip turns it")


def _plot_logged(ax: Any, result: dict[str, Any]) -> None:
    """Top right: the logged pre-clip norms, the start-up transient shaded, p95 marked."""
    norms = result["norms"]
    settle = len(norms) // 4
    ax.axvspan(0, settle, color="0.9", label=f"start-up transient (first {settle} steps)")
    ax.plot(norms, lw=0.8, label="pre-clip norm (unclipped run)")
    ax.axhline(result["suggested"], color="C3", ls="--",
               label=f"suggest_max_norm (p95) = {result['suggested']:.3g}")
    above = [(i, n) for i, n in enumerate(norms) if n > result["suggested"]]
    if above:
        ax.plot(*zip(*above), "x", color="C3", ms=4, label=f"{len(above)} steps above p95")
    ax.set_xlabel("step")
    ax.set_ylabel("gradient norm")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.set_title("choosing the limit from a logged run (spikes: clip_explode)", fontsize=10)


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(11, 8))
    origin = [0.0, 0.0]
    _plot_examples(ax1, result)
    _plot_logged(ax2, result)
    turn = result["turn"]
    unclipped = turn["unclipped"]
    size = math.hypot(*unclipped)
    for vec, label, color, width in (
        ([x / 50 for x in turn["rows"][0]], "task 1 row [30, 40] / 50", "lightgrey", 0.02),
        (turn["rows"][1], "task 2 row [-0.4, 0.3]", "C2", 0.01),
        ([x / size for x in unclipped], "unclipped sum / its norm", "C0", 0.01),
        (turn["combined"], "sum after TaskClip(1)", "C3", 0.01),
    ):
        ax3.quiver(*origin, *vec, angles="xy", scale_units="xy", scale=1, color=color,
                   label=label, width=width)
    _vector_axes(ax3, (-0.6, 1.0), (-0.1, 1.3), "lower right",
                 f"per-task clip of rows 90° apart: turned {turn['turn']:.1f}°")
    ax4.plot(result["sweep_between"], result["sweep_turn"], "o-", ms=3, color="C3",
             label="TaskClip(1), then Sum")
    ax4.axhline(turn["global_turn"], color="C0", ls="--", label="global clip of the sum")
    ax4.set_xlabel("angle between the two task rows (degrees; norms 50 and 0.5)")
    ax4.set_ylabel("turn of the combined update (degrees)")
    ax4.legend(loc="lower center")
    ax4.set_title("how far per-task clipping turns the update")
    fig.suptitle(TITLE)
    save_figure(fig, path)
