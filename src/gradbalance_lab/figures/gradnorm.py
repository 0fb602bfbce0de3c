"""§9.1 Renormalising GradNorm's weights.

Setting: a 3-task regression model (MLP trunk 8→32→32, linear heads; targets scaled 1, 10,
0.1; batches of 32 from 512 seeded samples), the network stepped through
:class:`~gradbalance.TaskGradBuffer` with the ``Sum`` balancer on the GradNorm-weighted
losses. The library's ``GradNorm`` (α = 1.5, the paper's Adam at lr 0.025 on the weights, the
trunk's last layer as ``W``) with ``renormalize=True`` (the paper's rescale to sum K inside
``no_grad``) and ``renormalize=False``; 200 steps (80 with ``--quick``), the same batches
for every run. The network's optimizer is ``torch.optim.Adam(lr=1e-3)`` (the paper's choice)
or ``torch.optim.SGD(lr=0.01)``.

Measured:

* the sum of the K = 3 weights after every update, with and without the rescale;
* whether the drift acts as a learning-rate change: the free run (``renormalize=False``) is
  replayed from the same initial network on the same batches with its own weights rescaled to
  sum K (``wₜ·K/Σwₜ``, no GradNorm update) at the constant ``lr``, and for SGD also at the
  learning rate ``lr·Σwₜ/K`` step by step. For SGD the step is linear in the weights, so the
  scheduled replay is the free run (the distance of the final networks, over the free run's
  own displacement); for both optimizers, the free run's step size over the constant-lr
  replay's, against ``Σw/K``: Adam divides each coordinate by its running scale, which a slow
  common factor barely moves;
* the ≈1250× of the text: the learning rates of GradNorm's own optimizer (the library's
  default) and the paper's network (2×10⁻⁵), and the step sizes they give: per step, the
  median ``|Δwₖ|`` over the median ``|Δθ|`` of the network's moving coordinates, over 20 steps
  with the network on ``Adam(lr=2e-5)`` (``renormalize=False``, so the weights' own steps are
  seen);
* the text's fragment (``L_grad.backward(inputs=[w])``, ``opt_w.step()``, the rescale inside
  ``no_grad``) run on a small case, against closed forms
  (:mod:`gradbalance_lab.figures._gradnorm_fragment`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, pyplot, require_attr, save_figure
from gradbalance_lab.figures._gradnorm_fragment import library_update, text_fragment
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "gradnorm"
TITLE = "§9.1 GradNorm's weights with and without renormalisation"
K = 3
NETWORK = {"adam": ("Adam", torch.optim.Adam, 1e-3), "sgd": ("SGD", torch.optim.SGD, 0.01)}
PAPER_NET_LR = 2e-5

Optimizer = Callable[..., torch.optim.Optimizer]


def _setup() -> tuple[MultiTaskModel, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(512, 8)
    targets = torch.stack([(x @ torch.randn(8)) * s for s in (1.0, 10.0, 0.1)], dim=1)
    return MultiTaskModel(mlp_trunk(8, 32, 2), make_heads(32, K)), x, targets


def _flat(model: MultiTaskModel) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def _run(renormalize: bool, steps: int, opt_cls: Optimizer = torch.optim.Adam,
         lr: float = 1e-3) -> dict[str, Any]:
    gradnorm_cls = require_attr("weighting", "GradNorm")
    model, x, targets = _setup()
    start = _flat(model)
    weighting = gradnorm_cls(K, model.trunk, alpha=1.5, lr=0.025, renormalize=renormalize)
    opt = opt_cls(model.parameters(), lr=lr)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer("sum")
    gen = torch.Generator().manual_seed(1)
    sums, weights, used, moves = [], [], [], []
    for _ in range(steps):
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        losses = regression_losses(model(x[idx]), targets[idx])
        used.append(weighting.weights.clone())
        before = _flat(model)
        buf.backward(weighting(losses))
        buf.apply_(balancer)
        opt.step()
        weighting.update()
        opt.zero_grad(set_to_none=True)
        moves.append(float((_flat(model) - before).norm()))
        w = weighting.weights
        sums.append(float(w.sum()))
        weights.append(w.tolist())
    return {"sum": sums, "weights": weights, "used": used, "moves": moves,
            "end": _flat(model), "start": start}


def _replay(used: list[torch.Tensor], opt_cls: Optimizer, lr: float,
            scheduled: bool) -> dict[str, Any]:
    """The same batches with the weights ``used`` rescaled to sum K; the learning rate
    ``lr·Σw/K`` per step when ``scheduled``, else ``lr``."""
    model, x, targets = _setup()
    opt = opt_cls(model.parameters(), lr=lr)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer("sum")
    gen = torch.Generator().manual_seed(1)
    moves = []
    for w in used:
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        losses = regression_losses(model(x[idx]), targets[idx])
        total = float(w.sum())
        for group in opt.param_groups:
            group["lr"] = lr * total / K if scheduled else lr
        before = _flat(model)
        buf.backward(losses * (w * K / total).to(losses.dtype))
        buf.apply_(balancer)
        opt.step()
        opt.zero_grad(set_to_none=True)
        moves.append(float((_flat(model) - before).norm()))
    return {"end": _flat(model), "moves": moves}


def _lr_ratio() -> dict[str, Any]:
    """GradNorm's own step against the network's on the paper's learning rates."""
    gradnorm_cls = require_attr("weighting", "GradNorm")
    model, x, targets = _setup()
    weighting = gradnorm_cls(K, model.trunk, alpha=1.5, renormalize=False)
    own_lr = float(weighting.optimizer.param_groups[0]["lr"])
    opt = torch.optim.Adam(model.parameters(), lr=PAPER_NET_LR)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    balancer = get_balancer("sum")
    gen = torch.Generator().manual_seed(1)
    ratios = []
    for _ in range(20):
        idx = torch.randint(0, x.shape[0], (32,), generator=gen)
        w_before, net_before = weighting.weights.clone(), _flat(model)
        buf.backward(weighting(regression_losses(model(x[idx]), targets[idx])))
        buf.apply_(balancer)
        opt.step()
        weighting.update()
        opt.zero_grad(set_to_none=True)
        dw = (weighting.weights - w_before).abs()
        dnet = (_flat(model) - net_before).abs()
        ratios.append(float(dw.median() / dnet[dnet > 0].median()))
    return {"own_lr": own_lr, "ratio_lr": own_lr / PAPER_NET_LR, "first": ratios[0],
            "median": float(torch.tensor(ratios).median())}


def compute(quick: bool = False) -> dict[str, Any]:
    steps = 80 if quick else 200
    on = _run(True, steps)
    result: dict[str, Any] = {"steps": steps, "on": on, "lr_ratio": _lr_ratio(),
                              "fragment": text_fragment(), "library_update": library_update()}
    for key, (_, cls, lr) in NETWORK.items():
        free = _run(False, steps, cls, lr)
        moved = float((free["end"] - free["start"]).norm())
        kinds = ("scheduled", "constant") if key == "sgd" else ("constant",)
        replays = {kind: _replay(free["used"], cls, lr, kind == "scheduled") for kind in kinds}
        result[key] = {
            "sum": free["sum"], "weights": free["weights"],
            "sum_end": free["sum"][-1],
            "gap": {kind: float((r["end"] - free["end"]).norm()) / moved
                    for kind, r in replays.items()},
            "step_ratio": [a / b for a, b in zip(free["moves"], replays["constant"]["moves"])],
        }
        if "scheduled" in replays:
            result[key]["step_ratio_scheduled"] = [
                a / b for a, b in zip(free["moves"], replays["scheduled"]["moves"])]
    result["off"] = {"sum": result["adam"]["sum"], "weights": result["adam"]["weights"]}
    result["drift_on"] = max(abs(s - K) for s in on["sum"])
    result["drift_off"] = max(abs(s - K) for s in result["adam"]["sum"])
    result["end_off"] = result["adam"]["sum"][-1]
    return result


def claims(result: dict[str, Any]) -> list[Claim]:
    sgd, adam, lr = result["sgd"], result["adam"], result["lr_ratio"]

    def ratio(r: dict[str, Any]) -> float:
        return float(sum(r["step_ratio"][-50:])) / 50

    def drift(r: dict[str, Any]) -> float:  # Σw/K over the same steps
        return float(sum(r["sum"][-50:])) / 50 / K

    absorbed = 1 - math.log(ratio(adam)) / math.log(drift(adam))

    return [
        Claim("§9.1 with the rescale after every step the weights sum to K = 3",
              f"largest |Σw − 3| over {result['steps']} steps: {result['drift_on']:.1e}",
              result["drift_on"] < 1e-9),
        Claim("§9.1 without it the weights' sum drifts",
              f"largest |Σw − 3|: {result['drift_off']:.3f}; sum at the end "
              f"{result['end_off']:.3f} (network on Adam; on SGD: {sgd['sum_end']:.3f})",
              result["drift_off"] > 0.05),
        Claim("§9.1 ... and acts as a learning-rate change: network on SGD",
              f"replay with the weights rescaled to sum K at lr·Σw/K ends "
              f"{sgd['gap']['scheduled']:.1e} from the free run (over its displacement), at "
              f"the constant lr {sgd['gap']['constant']:.1e}; free step / constant-lr replay's "
              f"over the last 50 steps {ratio(sgd):.2f} with Σw/K = {drift(sgd):.2f} there",
              sgd["gap"]["scheduled"] < 1e-4
              and sgd["gap"]["constant"] > 100 * sgd["gap"]["scheduled"]),
        Claim("§9.1 ... network on Adam (the paper's optimizer): the drift barely changes the "
              "step, Adam's per-coordinate scale takes the common factor out",
              f"free step / constant-lr replay's over the last 50 steps {ratio(adam):.2f} with "
              f"Σw/K = {drift(adam):.2f} there ({100 * absorbed:.0f}% of the factor absorbed, "
              f"in log terms); the replay ends {adam['gap']['constant']:.1e} from the free run "
              f"(over its displacement)", absorbed > 0.5),
        Claim("§9.1 the weights' optimizer: Adam at 0.025 against 2×10⁻⁵ for the network, "
              "about 1250 times larger",
              f"GradNorm's optimizer lr {lr['own_lr']:g} / {PAPER_NET_LR:g} = "
              f"{lr['ratio_lr']:.0f}; median |Δw| / median |Δθ|: {lr['first']:.0f} on the "
              f"first step, {lr['median']:.0f} over 20 steps",
              abs(lr["ratio_lr"] - 1250) < 1e-6 and abs(lr["first"] / 1250 - 1) < 0.01),
        _fragment_claim(result["fragment"], result["library_update"]),
    ]


def _fragment_claim(frag: dict[str, Any], lib: dict[str, Any]) -> Claim:
    return Claim(
        "§9.1 in the fragment L_grad trains only w; the rescale inside no_grad is not trained",
        f"the text's fragment: θ.grad after L_grad.backward(inputs=[w]) None, w.grad set: "
        f"{frag['only_w']}; after the rescale w is a leaf without grad_fn: {frag['leaf']}, "
        f"|Σw − K| {frag['sum_gap']:.0e}; next gradient in w vs its closed form at the "
        f"rescaled w {frag['closed_gap']:.0e}, vs the rescale differentiated through "
        f"{frag['in_graph_gap']:.3f} (that one's closed form to {frag['in_graph_closed_gap']:.0e}"
        f", orthogonal to w: {frag['in_graph_dot']:.0e}); the library's GradNorm update: "
        f"weights a leaf without grad_fn {lib['leaf']}, |Σw − K| {lib['sum_gap']:.0e}, "
        f"network .grad bitwise unchanged {lib['grad_same']}",
        frag["only_w"] and frag["leaf"] and frag["sum_gap"] < 1e-12
        and frag["closed_gap"] < 1e-12 and frag["in_graph_gap"] > 1e-3
        and frag["in_graph_closed_gap"] < 1e-12 and lib["leaf"] and lib["sum_gap"] < 1e-12
        and lib["grad_same"])


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.3))
    ax1.plot(result["on"]["sum"], label="renormalize=True")
    ax1.plot(result["adam"]["sum"], label="renormalize=False, network on Adam")
    ax1.plot(result["sgd"]["sum"], label="renormalize=False, network on SGD")
    ax1.axhline(K, color="grey", lw=0.8)
    ax1.set_xlabel("step")
    ax1.set_ylabel("sum of the weights Σw")
    ax1.set_title("Σw drifts without the rescale", fontsize=10)
    ax1.legend(fontsize=8)
    for key, style in (("on", "-"), ("off", "--")):
        columns = list(zip(*result[key]["weights"]))
        for k, col in enumerate(columns):
            ax2.plot(col, style, color=f"C{k}",
                     label=f"task {k}, {'renormalised' if key == 'on' else 'free'}")
    ax2.set_xlabel("step")
    ax2.set_ylabel("task weight wₖ")
    ax2.set_title("each task's weight (network on Adam)", fontsize=10)
    ax2.legend(fontsize=8, ncol=2)
    def smooth(values: list[float], n: int = 20) -> list[float]:
        return [sum(values[max(0, i - n + 1):i + 1]) / len(values[max(0, i - n + 1):i + 1])
                for i in range(len(values))]

    adam, sgd = result["adam"], result["sgd"]
    ax3.plot([s / K for s in adam["sum"]], ":", color="C1", lw=1.5, label="Adam: Σw/K")
    ax3.plot(smooth(adam["step_ratio"]), color="C1",
             label="Adam: free step / replay's at lr (20-step mean)")
    ax3.plot([s / K for s in sgd["sum"]], ":", color="C2", lw=1.5, label="SGD: Σw/K")
    ax3.plot(sgd["step_ratio_scheduled"], color="C2",
             label="SGD: free step / replay's at lr·Σw/K (identical runs)")
    ax3.axhline(1, color="grey", lw=0.8)
    ax3.set_xlabel("step")
    ax3.set_ylabel("ratio")
    ax3.set_title("replays with the weights rescaled to sum K", fontsize=10)
    ax3.legend(fontsize=8)
    fig.suptitle(TITLE)
    save_figure(fig, path)
