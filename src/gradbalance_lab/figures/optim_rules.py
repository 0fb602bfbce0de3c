"""§6, §7 and §9.2: SGD's and Adam's rules, stepped after the library's balanced gradient.

Setting (the rules): two tasks on ``w ∈ R³`` (float64) with the linear losses ``cₖₜ·w``, so
task ``k``'s gradient at step ``t`` is ``cₖₜ`` (three fixed steps of hand-picked numbers).
:class:`~gradbalance.TaskGradBuffer` with the ``Sum`` balancer writes ``gₜ = c₁ₜ + c₂ₜ`` into
``.grad``, then one ``torch.optim`` step. The expected weights and states are computed here
in plain Python floats from the rules as the text states them:

* SGD (§6): ``θ ← θ − lr·g``;
* Adam (§6): per coordinate ``m ← β₁m + (1 − β₁)g``, ``v ← β₂v + (1 − β₂)g²``,
  ``θ ← θ − lr·m̂/(√v̂ + ε)`` with ``m̂ = m/(1 − β₁ᵗ)``, ``v̂ = v/(1 − β₂ᵗ)`` (Kingma & Ba 2015);
  torch's ``exp_avg`` and ``exp_avg_sq`` are compared with ``m`` and ``v``;
* Adam with ``weight_decay`` (§9.2): ``g ← g + wd·θ`` before ``m`` and ``v``; the other
  reading (the decay kept out of ``m`` and ``v``, AdamW's) is computed too, and the row is met
  only when torch's state matches the first and not the second.

The ten-step average (§6, β₁ = 0.9): ``Adam``'s ``exp_avg`` fed a gradient that steps from 0
to 1. Its lag is the mean delay of the response, ``Σₙ (1 − mₙ)`` over the steps after the
change; closed form ``β₁/(1 − β₁)`` = 9 steps (the window of ``1/(1 − β₁)`` = 10 steps less
the current one). Its smoothing: fed standard Gaussian gradients (20,000 steps, 5 seeds), the
standard deviation of ``exp_avg`` over the gradient's (the first 100 steps left out; the
5 seeds are 5 coordinates of one parameter, each its own run), closed form
``√((1 − β₁)/(1 + β₁))`` = 0.229 (a first-order recursion's stationary variance). Met when
the lag matches its closed form and the closed form of the smoothing lies within the seeds'
mean ± 3 standard errors.

Common factors (§7): the two-bowl example (:mod:`._common`, gradient noise σ = 1) run through
the library with the ``Sum`` and the ``Mean`` balancer (``Mean`` = ``Sum``/2 for two tasks: a
change of the balancer's output common to every coordinate), 300 steps at lr 0.01, the same
noise. Adam divides each coordinate by its running scale, so its steps are expected equal up to
the ε term (closed form: ``m̂/(√v̂ + 2ε)`` against ``m̂/(√v̂ + ε)``), every step; SGD (the
control) takes a first step half as long, and its two runs then part.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, TwoBowls, mean_se, pyplot, save_figure

NAME = "optim_rules"
TITLE = "§6, §7, §9.2 SGD's and Adam's rules against their closed forms"
#: task gradients c[t][k] per step, and the start
GRADS = (((0.5, -1.0, 2.0), (0.25, 3.0, -1.0)),
         ((-2.0, 0.5, 0.0), (1.0, 1.0, 1.5)),
         ((4.0, -3.0, 0.5), (-0.5, 0.25, 2.0)))
START = (1.0, -2.0, 0.5)
LR, WD = 0.1, 0.5
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8
SEEDS = 5


def _library_steps(make_opt: Any) -> dict[str, Any]:
    """The three steps through ``TaskGradBuffer`` + ``Sum`` and ``make_opt``: the weights and
    the optimizer state after each."""
    w = torch.nn.Parameter(torch.tensor(START, dtype=torch.float64))
    opt = make_opt([w])
    buf = TaskGradBuffer([w], num_tasks=2)
    balancer = get_balancer("sum")
    out: dict[str, Any] = {"w": [], "m": [], "v": []}
    for step in GRADS:
        c = torch.tensor(step, dtype=torch.float64)
        buf.backward((c * w).sum(dim=1))
        buf.apply_(balancer)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["w"].append(w.detach().tolist())
        state = opt.state[w]
        out["m"].append(state["exp_avg"].tolist() if "exp_avg" in state else [])
        out["v"].append(state["exp_avg_sq"].tolist() if "exp_avg_sq" in state else [])
    return out


def _by_hand(rule: str) -> dict[str, list[list[float]]]:
    """The same three steps in plain floats: ``sgd``, ``adam``, ``adam_wd`` (coupled decay)
    or ``decoupled`` (the decay kept out of m and v, then applied to the weights)."""
    w, m, v = list(START), [0.0] * 3, [0.0] * 3
    out: dict[str, list[list[float]]] = {"w": [], "m": [], "v": []}
    for t, step in enumerate(GRADS, start=1):
        g = [a + b for a, b in zip(*step)]
        if rule == "sgd":
            w = [wi - LR * gi for wi, gi in zip(w, g)]
        else:
            if rule == "adam_wd":
                g = [gi + WD * wi for gi, wi in zip(g, w)]
            if rule == "decoupled":
                w = [wi * (1 - LR * WD) for wi in w]
            m = [BETA1 * mi + (1 - BETA1) * gi for mi, gi in zip(m, g)]
            v = [BETA2 * vi + (1 - BETA2) * gi * gi for vi, gi in zip(v, g)]
            mh = [mi / (1 - BETA1**t) for mi in m]
            vh = [vi / (1 - BETA2**t) for vi in v]
            w = [wi - LR * a / (math.sqrt(b) + EPS) for wi, a, b in zip(w, mh, vh)]
        out["w"].append(w)
        out["m"].append(m)
        out["v"].append(v)
    return out


def _gap(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def _rules() -> dict[str, Any]:
    sgd = _library_steps(lambda p: torch.optim.SGD(p, lr=LR))
    adam = _library_steps(lambda p: torch.optim.Adam(p, lr=LR))
    adam_wd = _library_steps(lambda p: torch.optim.Adam(p, lr=LR, weight_decay=WD))
    hand = {rule: _by_hand(rule) for rule in ("sgd", "adam", "adam_wd", "decoupled")}
    return {
        "sgd": _gap(sgd["w"], hand["sgd"]["w"]),
        "adam": max(_gap(adam[k], hand["adam"][k]) for k in ("w", "m", "v")),
        "shapes": [len(adam["m"][-1]), len(adam["v"][-1])],
        "adam_wd": max(_gap(adam_wd[k], hand["adam_wd"][k]) for k in ("w", "m", "v")),
        "adam_wd_vs_decoupled": _gap(adam_wd["m"], hand["decoupled"]["m"]),
        "adam_wd_m1": adam_wd["m"][0],
    }


def _exp_avg(grads: torch.Tensor) -> torch.Tensor:
    """Adam's ``exp_avg`` (β₁ = 0.9) after each row of the gradients ``grads`` ``[n, d]``
    (each of the d coordinates is a run of its own: Adam's state is per coordinate)."""
    w = torch.nn.Parameter(torch.zeros(grads.shape[1], dtype=torch.float64))
    opt = torch.optim.Adam([w], lr=1e-3, betas=(BETA1, BETA2))
    out = []
    for g in grads:
        w.grad = g.clone()
        opt.step()
        out.append(opt.state[w]["exp_avg"].clone())
    return torch.stack(out)


def _average(steps: int) -> dict[str, Any]:
    """The lag after a step change and the smoothing of noise of ``exp_avg``."""
    change = torch.cat([torch.zeros(50, 1, dtype=torch.float64),
                        torch.ones(400, 1, dtype=torch.float64)])
    response = _exp_avg(change)[:, 0].tolist()
    lag = sum(1.0 - m for m in response[50:])
    noise = torch.stack([torch.randn(steps, generator=torch.Generator().manual_seed(seed),
                                     dtype=torch.float64) for seed in range(SEEDS)], dim=1)
    avg = _exp_avg(noise)[100:]
    ratios = (avg.std(dim=0) / noise[100:].std(dim=0)).tolist()
    return {"response": response[40:120], "lag": lag, "ratios": ratios,
            "trace": [noise[100:300, 0].tolist(), avg[:200, 0].tolist()],
            "lag_closed": BETA1 / (1 - BETA1),
            "ratio_closed": math.sqrt((1 - BETA1) / (1 + BETA1))}


def _common_factor(steps: int) -> dict[str, Any]:
    """Two-bowl runs with ``Sum`` and ``Mean`` under Adam and SGD (the same noise)."""
    out: dict[str, Any] = {}
    for opt_name, cls in (("adam", torch.optim.Adam), ("sgd", torch.optim.SGD)):
        runs = {}
        for name in ("sum", "mean"):
            bowls = TwoBowls(noise=1.0, seed=0)
            runs[name] = bowls.train(get_balancer(name), lambda p, c=cls: c(p, lr=0.01), steps)
        ratios = [b / a for a, b in zip(runs["sum"]["step"], runs["mean"]["step"]) if a > 0]
        ends = [torch.tensor([r["x"][-1], r["y"][-1]], dtype=torch.float64)
                for r in runs.values()]
        out[opt_name] = {"paths": {k: (r["x"], r["y"]) for k, r in runs.items()},
                         "ratio_lo": min(ratios), "ratio_hi": max(ratios), "first": ratios[0],
                         "end_gap": float((ends[0] - ends[1]).norm())}
    return out


def compute(quick: bool = False) -> dict[str, Any]:
    return {"rules": _rules(), "average": _average(4000 if quick else 20000),
            "common": _common_factor(100 if quick else 300)}


def claims(result: dict[str, Any]) -> list[Claim]:
    r, avg, common = result["rules"], result["average"], result["common"]
    ratios = avg["ratios"]
    mean, se = mean_se(ratios)
    adam, sgd = common["adam"], common["sgd"]
    return [
        Claim("§6 plain SGD steps against the gradient times the learning rate",
              f"3 steps after TaskGradBuffer + Sum: weights vs θ − lr·g by hand to "
              f"{r['sgd']:.0e}", r["sgd"] < 1e-15),
        Claim("§6 Adam keeps two running averages for each coordinate of the gradient",
              f"exp_avg and exp_avg_sq hold {r['shapes'][0]} and {r['shapes'][1]} entries (3 "
              f"coordinates); weights, m and v vs Kingma & Ba's rule by hand to "
              f"{r['adam']:.0e}", r["adam"] < 1e-12 and r["shapes"] == [3, 3]),
        Claim("§6 the ten-step average (β₁ = 0.9) smooths noise but lags",
              f"lag after a step change {avg['lag']:.4f} steps (closed form β₁/(1 − β₁) = "
              f"{avg['lag_closed']:g}); std of exp_avg / std of the gradient "
              f"{min(ratios):.4f}–{max(ratios):.4f} over {len(ratios)} seeds, mean "
              f"{mean:.4f} ± {3 * se:.4f} (3 s.e.), closed form {avg['ratio_closed']:.4f}",
              abs(avg["lag"] - avg["lag_closed"]) < 1e-9
              and abs(mean - avg["ratio_closed"]) <= 3 * se),
        Claim("§7 the per-coordinate division cancels some of the balancer's changes: a "
              "change common to every coordinate (Mean instead of Sum, the step × ½)",
              f"two-bowl example, the same noise: Adam's step with Mean / with Sum "
              f"{adam['ratio_lo']:.9f}–{adam['ratio_hi']:.9f} (closed form 1 up to ε); "
              f"end points {adam['end_gap']:.1e} apart; SGD (control): first step "
              f"{sgd['first']:.6f} (closed form 0.5), end points {sgd['end_gap']:.3f} apart",
              abs(adam["ratio_lo"] - 1) < 1e-6 and abs(adam["ratio_hi"] - 1) < 1e-6
              and abs(sgd["first"] - 0.5) < 1e-12 and sgd["end_gap"] > 1e3 * adam["end_gap"]),
        Claim("§9.2 Adam adds wd times the weights to the gradient before m and v",
              f"wd = {WD:g}: weights, m and v vs the coupled rule by hand to "
              f"{r['adam_wd']:.0e}; m vs the decoupled reading (AdamW's) "
              f"{r['adam_wd_vs_decoupled']:.3f} apart",
              r["adam_wd"] < 1e-12 and r["adam_wd_vs_decoupled"] > 1e-3),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.4))
    avg = result["average"]
    resp = avg["response"]
    steps = list(range(-10, len(resp) - 10))
    ax1.step(steps, [0.0 if n < 0 else 1.0 for n in steps], where="post", color="grey",
             label="gradient: 0, then 1")
    ax1.plot(steps, resp, "o", ms=3, color="C0", label="Adam's exp_avg (β₁ = 0.9)")
    ax1.plot([n for n in steps if n >= 0], [1 - BETA1 ** (n + 1) for n in steps if n >= 0],
             color="C1", lw=0.9, label="closed form 1 − β₁ⁿ⁺¹")
    ax1.set_title(f"lag {avg['lag']:.2f} steps = β₁/(1 − β₁)", fontsize=10)
    ax1.set_xlabel("steps after the change")
    ax1.legend(fontsize=8)
    noise, trace = avg["trace"]
    ax2.plot(noise, color="lightgrey", lw=0.8, label="gradient (standard Gaussian)")
    ax2.plot(trace, color="C0", lw=1.2, label="exp_avg")
    ax2.set_title(f"std ratio {sum(avg['ratios']) / len(avg['ratios']):.3f} (closed form "
                  f"{avg['ratio_closed']:.3f})", fontsize=10)
    ax2.set_xlabel("step")
    ax2.legend(fontsize=8)
    for opt_name, color in (("adam", "C0"), ("sgd", "C3")):
        for name, ls in (("sum", "-"), ("mean", "--")):
            x, y = result["common"][opt_name]["paths"][name]
            ax3.plot(x, y, color=color, ls=ls, lw=1.4 if ls == "-" else 1.0,
                     label=f"{opt_name.upper() if opt_name == 'sgd' else 'Adam'}, {name}")
    ax3.plot(*zip(*[(3.0, 0.0), (0.0, 3.0)]), "k:", lw=0.8, label="Pareto set")
    ax3.set_title("Sum vs Mean: Adam's paths coincide, SGD's do not", fontsize=10)
    ax3.set_xlabel("w₁")
    ax3.set_ylabel("w₂")
    ax3.legend(fontsize=8)
    fig.suptitle(TITLE)
    save_figure(fig, path, rect=(0, 0, 1, 0.95))
