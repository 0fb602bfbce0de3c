"""§13 What to log: the scalars of a short run, drawn like TensorBoard's scalar panels.

Setting: a 3-task regression model (MLP trunk 8→32→32, linear heads, targets scaled 1, 10,
0.1) trained for 120 steps (40 with ``--quick``) with ``torch.optim.Adam(lr=1e-2)``, the
``PCGrad`` balancer (``Mean`` if absent) through :class:`~gradbalance.TaskGradBuffer`, an
enabled ``torch.amp.GradScaler("cpu")``, and the global ``clip_grad_norm_`` after
``scaler.unscale_`` at ``max_norm = 60``, about the 90th–95th percentile of this run's pre-clip
norms (5 to 90), so it catches the largest steps only, as the clip tutorial advises.
PCGrad weights no loss: the ``w/`` tags hold the coefficients of its combine (each task row's
share of ``.grad``, 1 when it is not projected), drawn as such; the text's ``w`` is a
loss-weighting method's. At one step (a third of the way) task 0's loss is made to
overflow, so the scaler skips that step. Every step,
:func:`gradbalance.log_stats` writes the text's scalars to a writer with ``add_scalar``
(a recording stand-in for ``SummaryWriter``, so tensorboard is not needed).

Checked: every tag of the text is logged every step (``loss/``, ``size/``, ``w/`` per task,
``cos/task0_task1``, ``pre_clip``, ``amp_skipped``); ``amp_skipped`` is 1 exactly at the
overflow step; the logged ``cos/task0_task1`` and ``size/task0`` at the last step equal the
text's formula on ``G / s`` recomputed independently with :func:`torch.autograd.grad`; and
``cos/task0_task1`` logged for two task gradients that agree, meet at a right angle and
oppose each other is 1, 0 and −1/√1.25, their cosines by hand.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import BALANCERS, get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, require_attr, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "logging"
TITLE = "§13 The logged scalars of a short run"
K = 3
MAX_NORM = 60.0


class RecordingWriter:
    """Collects ``add_scalar(tag, value, step)`` calls: ``{tag: [(step, value), ...]}``."""

    def __init__(self) -> None:
        self.scalars: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.scalars[tag].append((step, float(value)))


def compute(quick: bool = False) -> dict[str, Any]:
    log_stats = require_attr("monitor", "log_stats")
    steps = 40 if quick else 120
    bad_step = steps // 3
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    targets = torch.stack([(x @ torch.randn(8)) * s for s in (1.0, 10.0, 0.1)], dim=1)
    model = MultiTaskModel(mlp_trunk(8, 32, 2), make_heads(32, K))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    if not scaler.is_enabled():
        raise RuntimeError("torch.amp.GradScaler('cpu') is disabled in this torch build")
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer("pcgrad" if "pcgrad" in BALANCERS else "mean")
    writer = RecordingWriter()
    gen = torch.Generator().manual_seed(1)
    check: dict[str, float] = {}
    for step in range(steps):
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        losses = regression_losses(model(x[idx]), targets[idx])
        if step == bad_step:
            losses = losses * torch.tensor([math.inf, 1.0, 1.0])
        if step == steps - 1:  # the text's formula on G / s, computed apart
            rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(
                losses[k], model.shared_parameters(), retain_graph=True)]) for k in range(2)]
            g1, g2 = rows[0].double(), rows[1].double()
            check = {"cos": float(g1 @ g2 / (g1.norm() * g2.norm())), "size0": float(g1.norm())}
        s = scaler.get_scale()
        buf.backward(losses, scaler=scaler)
        stats = buf.apply_(balancer, scaler=scaler)
        scaler.unscale_(opt)
        pre_clip = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        skipped = scaler.get_scale() < s
        log_stats(writer, stats, step, pre_clip=pre_clip, amp_skipped=skipped)
    return {"steps": steps, "bad_step": bad_step, "scalars": dict(writer.scalars),
            "check": check, "signs": _sign_cases(log_stats)}


#: Two task gradients that agree, meet at a right angle and oppose each other, with their
#: cosines by hand: 1, 0 and −1/√1.25.
SIGN_CASES = (((1.0, 0.0), (2.0, 0.0), 1.0), ((1.0, 0.0), (0.0, 3.0), 0.0),
              ((1.0, 0.0), (-1.0, 0.5), -1.0 / math.sqrt(1.25)))


def _sign_cases(log_stats: Any) -> list[tuple[float, float]]:
    """``(by hand, logged)`` ``cos/task0_task1`` of one balanced step of the losses ``aₖ·θ``
    (task gradients exactly ``aₖ``) for each of :data:`SIGN_CASES`."""
    out = []
    for first, second, expected in SIGN_CASES:
        theta = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
        rows = torch.tensor([first, second], dtype=torch.float64)
        buf = TaskGradBuffer([theta])
        buf.backward(rows @ theta)
        writer = RecordingWriter()
        log_stats(writer, buf.apply_(get_balancer("mean")), 0)
        out.append((expected, writer.scalars["cos/task0_task1"][0][1]))
    return out


EXPECTED_TAGS = ([f"loss/task{k}" for k in range(K)] + [f"size/task{k}" for k in range(K)]
                 + [f"w/task{k}" for k in range(K)] + ["cos/task0_task1", "pre_clip",
                                                        "amp_skipped"])


def claims(result: dict[str, Any]) -> list[Claim]:
    scalars = result["scalars"]
    steps = result["steps"]
    # A skipped step never calls the balancer, so it has no weights to log.
    missing = [t for t in EXPECTED_TAGS
               if len(scalars.get(t, [])) != steps - (1 if t.startswith("w/") else 0)]
    skipped_at = [s for s, v in scalars.get("amp_skipped", []) if v == 1.0]
    last_cos = scalars["cos/task0_task1"][-1][1] if "cos/task0_task1" in scalars else math.nan
    last_size = scalars["size/task0"][-1][1] if "size/task0" in scalars else math.nan
    check = result["check"]
    return [
        Claim("§13 per task the raw loss, the true gradient size and the weight; cos of tasks 0 "
              "and 1; the pre-clip norm; whether the step was skipped",
              f"{len(scalars)} tags logged every step (w/ on every step not skipped); "
              f"missing: {', '.join(missing) or 'none'}",
              not missing),
        Claim("§13 amp_skipped marks the step the scaler dropped",
              f"skipped at {skipped_at} (overflow injected at {result['bad_step']})",
              skipped_at == [result["bad_step"]]),
        Claim("§13 the logged cosine and size are the text's formula on G / s (check)",
              f"cos {last_cos:.6f} vs {check['cos']:.6f}; size {last_size:.6f} vs "
              f"{check['size0']:.6f}",
              abs(last_cos - check["cos"]) < 1e-5
              and abs(last_size / check["size0"] - 1) < 1e-5),
        Claim("§13 cosine similarity is 1 when they agree, 0 at a right angle, negative when "
              "opposed",
              "logged vs by hand: " + ", ".join(f"{got:.6f} vs {want:.6f}"
                                                 for want, got in result["signs"]),
              all(abs(got - want) < 1e-12 for want, got in result["signs"])),
        Claim("§13 compare each raw loss with that task trained alone, and log how much each "
              "number varies, not only its average", "advice; not run here",
              reason="a recommendation for the reader's own runs, with no outcome the text "
                     "states"),
    ]


def _smooth(values: list[float], weight: float = 0.6) -> list[float]:
    """TensorBoard's exponential smoothing (ignores non-finite values)."""
    out, last = [], None
    for v in values:
        if math.isfinite(v):
            last = v if last is None else weight * last + (1 - weight) * v
        out.append(math.nan if last is None else last)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    panels = [("loss", "loss/"), ("size", "size/"),
              ("w/: PCGrad's combine coefficients (no loss weights)", "w/"), ("cos", "cos/"),
              ("pre_clip", "pre_clip"), ("amp_skipped", "amp_skipped")]
    ylabels = {"loss/": "raw task loss (log)", "size/": "true gradient norm ‖G/s‖ (log)",
               "w/": "PCGrad's coefficient per task row", "cos/": "cosine of two tasks' gradients",
               "pre_clip": "norm before clipping (log)",
               "amp_skipped": "step skipped (1) or not (0)"}
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    scalars = result["scalars"]
    for ax, (title, prefix) in zip(axes.flat, panels):
        tags = sorted(t for t in scalars if t.startswith(prefix) and not t.startswith("std/")
                      and (prefix != "pre_clip" or t == "pre_clip"))
        for i, tag in enumerate(tags):
            steps = [s for s, _ in scalars[tag]]
            values = [v for _, v in scalars[tag]]
            if prefix == "amp_skipped":  # a flag: raw, not smoothed
                ax.step(steps, values, where="mid", color=f"C{i}", label=tag)
                continue
            ax.plot(steps, values, color=f"C{i}", alpha=0.25, lw=0.8)
            ax.plot(steps, _smooth(values), color=f"C{i}", lw=1.5, label=tag)
        if prefix in ("loss/", "size/", "pre_clip"):
            ax.set_yscale("log")
        if prefix == "pre_clip":
            values = [v for _, v in scalars.get("pre_clip", [])]
            share = sum(v > MAX_NORM for v in values) / max(1, len(values))
            ax.axhline(MAX_NORM, color="C3", ls="--",
                       label=f"max_norm {MAX_NORM:g}: {share:.0%} of steps clipped")
            ax.legend(fontsize=7)
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_ylabel(ylabels[prefix], fontsize=9)
        ax.grid(alpha=0.3)
        if len(tags) > 1:
            ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.suptitle(TITLE)
    save_figure(fig, path)
