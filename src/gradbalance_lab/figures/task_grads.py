"""§3 Task gradients over the shared parameters, and §4 where loss weights act.

Setting: a 3-task regression model in float64 (MLP trunk 6→16→16, one linear head per task,
seeded), targets ``y_k = x·a_k + noise`` with the scales 1, 10 and 0.1. The text's step (its
``flat_grad``, ``fill_grads`` and ``total.backward(inputs=head_ps)``) is written out here as
in the text; the library's step is :class:`~gradbalance.TaskGradBuffer` (``passes="loop"``,
the CPU default) and :func:`gradbalance.task_gradients`. The independent references are
plain ``torch.autograd.grad`` calls on fresh forward passes.

Measured:

* batch means: the trunk gradient of task 0's ``MSELoss()`` (mean) and of
  ``MSELoss(reduction="sum")`` for batches of n = 8 … 2048 samples (5 data seeds each); the
  slope of log ‖g‖ against log n (0: does not grow; 1: grows as n);
* ``torch.autograd.grad`` leaves ``.grad`` alone: every ``.grad`` is set to a marker first
  and compared bitwise after the K calls; the rows against per-task references;
* ``retain_graph``: the second task's call without ``retain_graph=True`` on the same forward;
* K backward passes: a hook on the trunk's output counts the passes through the trunk in one
  library ``backward``; ``G`` is ``[K, P]``;
* the heads' plain gradient: after the library's step with ``PCGrad`` (and after the text's
  step with the same combine), each head's ``.grad`` against ``∂(Σₖ Lₖ)/∂head``, and the
  trunk's against ``PCGrad(G)``;
* weighted losses ``Σₖ wₖ Lₖ`` (w = 0.5, 2, 3): each head's gradient over its plain one; each
  row of ``G`` over the unweighted row (its length ratio and cosine), and how far ``PCGrad``
  turns the combined step from the plain sum;
* ``vector_to_parameters(g, body)`` on a copy: the weights become ``g``, ``.grad`` is
  unchanged.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import grad

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance.taskgrads import task_gradients
from gradbalance_lab.figures._common import (
    Claim,
    angle_deg,
    grad_of,
    pyplot,
    require_balancer,
    save_figure,
)
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "task_grads"
TITLE = "§3 Task gradients over the shared parameters (and §4 loss weights)"
K = 3
SIZES = (8, 32, 128, 512, 2048)
SEEDS = 5
WEIGHTS = (0.5, 2.0, 3.0)
SCALES = (1.0, 10.0, 0.1)


def _model() -> MultiTaskModel:
    torch.manual_seed(0)
    return MultiTaskModel(mlp_trunk(6, 16, 2), make_heads(16, K)).double()


def _data(n: int, seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    coef = torch.randn(6, K, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    x = torch.randn(n, 6, generator=gen, dtype=torch.float64)
    y = (x @ coef + 0.5 * torch.randn(n, K, generator=gen, dtype=torch.float64))
    return x, y * torch.tensor(SCALES, dtype=torch.float64)


def _flat(grads: tuple[Tensor, ...]) -> Tensor:
    return torch.cat([g.reshape(-1) for g in grads])


def flat_grad(loss: Tensor, body: Sequence[Tensor], retain: bool = True) -> Tensor:
    """The text's ``flat_grad``: one ``torch.autograd.grad`` call, flattened."""
    return _flat(grad(loss, body, retain_graph=retain))


def fill_grads(params: Sequence[Tensor], vec: Tensor) -> None:
    """The text's ``fill_grads``: write a flat vector into each ``.grad``."""
    i = 0
    for p in params:
        n = p.numel()
        p.grad = vec[i:i + n].view_as(p).clone()
        i += n


def _slope(xs: list[float], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def _batch_means() -> dict[str, Any]:
    model = _model()
    body = model.shared_parameters()
    norms: dict[str, list[list[float]]] = {"mean": [], "sum": []}
    for n in SIZES:
        row: dict[str, list[float]] = {"mean": [], "sum": []}
        for seed in range(SEEDS):
            x, y = _data(n, seed)
            pred = model(x)[0].squeeze(-1)
            losses = [nn.MSELoss()(pred, y[:, 0]), nn.MSELoss(reduction="sum")(pred, y[:, 0])]
            g = task_gradients(losses, body)
            row["mean"].append(float(g[0].norm()))
            row["sum"].append(float(g[1].norm()))
        norms["mean"].append(row["mean"])
        norms["sum"].append(row["sum"])
    med = {k: [sorted(v)[SEEDS // 2] for v in rows] for k, rows in norms.items()}
    return {"n": list(SIZES), "norms": norms, "median": med,
            "slope_mean": _slope(list(SIZES), med["mean"]),
            "slope_sum": _slope(list(SIZES), med["sum"])}


def _references(model: MultiTaskModel, x: Tensor, y: Tensor) -> dict[str, Tensor]:
    """Per-task trunk rows and the heads' gradient of Σₖ Lₖ, each from a fresh forward."""
    body, heads = model.shared_parameters(), model.head_parameters()
    rows = [_flat(grad(regression_losses(model(x), y)[k], body)) for k in range(K)]
    head = _flat(grad(regression_losses(model(x), y).sum(), heads))
    return {"G": torch.stack(rows), "heads": head}


def _text_step(model: MultiTaskModel, x: Tensor, y: Tensor, combine: Any) -> Tensor:
    """The text's step (section 3) with ``combine`` in place of the plain sum: ``.grad``."""
    body, head_ps = model.shared_parameters(), model.head_parameters()
    model.zero_grad(set_to_none=True)
    losses = list(regression_losses(model(x), y))
    rows = [flat_grad(L, body) for L in losses]
    g = combine(torch.stack(rows))
    fill_grads(body, g)
    total = sum(losses)
    assert isinstance(total, Tensor)
    torch.autograd.backward(total, inputs=head_ps)
    return torch.cat([grad_of(p).reshape(-1) for p in [*body, *head_ps]])


def compute(quick: bool = False) -> dict[str, Any]:
    require_balancer("pcgrad")
    result: dict[str, Any] = {"batch": _batch_means()}
    model = _model()
    body, heads = model.shared_parameters(), model.head_parameters()
    x, y = _data(64, 0)
    ref = _references(model, x, y)

    # autograd.grad leaves .grad alone; the rows are the per-task gradients.
    for i, p in enumerate(model.parameters()):
        p.grad = torch.full_like(p, 7.0 + i)
    marks = [grad_of(p).clone() for p in model.parameters()]
    losses = regression_losses(model(x), y)
    text_rows = torch.stack([flat_grad(losses[k], body) for k in range(K)])
    lib_rows = task_gradients(regression_losses(model(x), y), body)
    result["grad_untouched"] = all(torch.equal(m, grad_of(p))
                                   for m, p in zip(marks, model.parameters()))
    result["rows_gap"] = max(float((text_rows - ref["G"]).abs().max()),
                             float((lib_rows - ref["G"]).abs().max()))
    model.zero_grad(set_to_none=True)

    # retain_graph: the second task's call on the same graph.
    losses = regression_losses(model(x), y)
    flat_grad(losses[0], body, retain=False)
    try:
        flat_grad(losses[1], body, retain=False)
        result["second_without"] = "no error"
    except RuntimeError as error:
        result["second_without"] = f"RuntimeError: {str(error).split('.')[0]}"
    losses = regression_losses(model(x), y)
    result["with_retain"] = len([flat_grad(L, body) for L in losses])

    # K backward passes through the trunk in one library backward.
    passes = []
    buf = TaskGradBuffer(body, heads, passes="loop")
    feats = model.trunk(x)
    feats.register_hook(lambda g: passes.append(1))
    outs = [h(feats) for h in model.heads]
    buf.backward(regression_losses(outs, y))
    matrix = buf.matrix
    assert matrix is not None
    result["passes"] = len(passes)
    result["matrix_shape"] = list(matrix.shape)
    result["params"] = sum(p.numel() for p in body)

    # The heads keep their plain gradient (library step with PCGrad, and the text's step).
    torch.manual_seed(11)
    stats = buf.apply_(get_balancer("pcgrad"))
    lib = torch.cat([grad_of(p).reshape(-1) for p in [*body, *heads]])
    torch.manual_seed(11)
    pcgrad = get_balancer("pcgrad")
    n_body = result["params"]
    result["lib_trunk_gap"] = float((lib[:n_body] - pcgrad(ref["G"])).abs().max())
    result["lib_head_gap"] = float((lib[n_body:] - ref["heads"]).abs().max())
    torch.manual_seed(11)
    pcgrad = get_balancer("pcgrad")
    text = _text_step(model, x, y, pcgrad)
    result["text_gap"] = float((text - lib).abs().max())
    result["pcgrad_turn"] = angle_deg(lib[:n_body], ref["G"].sum(dim=0))
    result["update_norm"] = float(stats.update_norm or 0.0)
    model.zero_grad(set_to_none=True)

    # Weighted losses: heads scaled by w_k; rows of G scaled, not turned.
    w = torch.tensor(WEIGHTS, dtype=torch.float64)
    weighted = regression_losses(model(x), y) * w
    torch.autograd.backward(weighted.sum())
    head_plain = [_flat(grad(regression_losses(model(x), y)[k], list(h.parameters())))
                  for k, h in enumerate(model.heads)]
    result["head_ratio"] = [
        float(torch.cat([grad_of(p).reshape(-1) for p in h.parameters()]).norm()
              / head_plain[k].norm()) for k, h in enumerate(model.heads)]
    result["head_plain"] = [float(g.norm()) for g in head_plain]
    wrows = task_gradients(regression_losses(model(x), y) * w, body)
    result["row_ratio"] = (wrows.norm(dim=1) / ref["G"].norm(dim=1)).tolist()
    result["row_cos"] = [float(a @ b / (a.norm() * b.norm())) for a, b in zip(wrows, ref["G"])]
    model.zero_grad(set_to_none=True)

    # vector_to_parameters overwrites the weights, not their gradients.
    twin = copy.deepcopy(model)
    twin_body = twin.shared_parameters()
    for p in twin_body:
        p.grad = torch.zeros_like(p)
    g = ref["G"].sum(dim=0)
    nn.utils.vector_to_parameters(g, twin_body)
    after = torch.cat([p.detach().reshape(-1) for p in twin_body])
    result["v2p_weights_gap"] = float((after - g).abs().max())
    result["v2p_grad_untouched"] = all(bool((grad_of(p) == 0).all()) for p in twin_body)
    return result


def claims(result: dict[str, Any]) -> list[Claim]:
    b = result["batch"]
    med = b["median"]
    return [
        Claim("§3 each loss is a batch mean, so gradients do not grow with batch size",
              f"‖g‖ (mean reduction, median of {SEEDS} seeds) "
              + ", ".join(f"{v:.3f}" for v in med["mean"])
              + f" for n = {', '.join(map(str, b['n']))}: slope {b['slope_mean']:+.2f} "
              f"(sum reduction: slope {b['slope_sum']:.2f})",
              abs(b["slope_mean"]) < 0.1 and abs(b["slope_sum"] - 1) < 0.1),
        Claim("§3 one torch.autograd.grad call per task returns its gradient without touching "
              ".grad", f"every .grad bitwise unchanged: {result['grad_untouched']}; rows "
              f"(text's flat_grad and task_gradients) equal the per-task gradients to "
              f"{result['rows_gap']:.0e}",
              result["grad_untouched"] and result["rows_gap"] < 1e-12),
        Claim("§3 retain_graph=True keeps the graph for the next task",
              f"second task without it: {result['second_without']}; with it: "
              f"{result['with_retain']} of {K} calls", result["second_without"] !=
              "no error" and result["with_retain"] == K),
        Claim("§3 every step costs K backward passes and K copies of the shared gradient",
              f"passes through the trunk in one backward: {result['passes']} (K = {K}); G is "
              f"{result['matrix_shape'][0]} × {result['matrix_shape'][1]} (P = "
              f"{result['params']})",
              result["passes"] == K and result["matrix_shape"] == [K, result["params"]]),
        Claim("§3 writing into the shared .grad leaves each head its own plain gradient",
              f"heads' .grad after the library's PCGrad step vs ∂(ΣL)/∂head: "
              f"{result['lib_head_gap']:.0e}; trunk vs PCGrad(G): {result['lib_trunk_gap']:.0e};"
              f" the text's step (same combine) vs the library's: {result['text_gap']:.0e}",
              max(result["lib_head_gap"], result["lib_trunk_gap"], result["text_gap"])
              < 1e-12),
        Claim("§3 backpropagating weighted losses scales the heads' gradients too",
              "head gradient / plain, w = " + ", ".join(map(str, WEIGHTS)) + ": "
              + ", ".join(f"{r:.6f}" for r in result["head_ratio"]),
              all(abs(r - w) < 1e-9 for r, w in zip(result["head_ratio"], WEIGHTS))),
        Claim("§4 loss weights change a task gradient's length, never its direction",
              "row length ratio " + ", ".join(f"{r:.6f}" for r in result["row_ratio"])
              + "; cosine " + ", ".join(f"{c:.12f}" for c in result["row_cos"]),
              all(abs(r - w) < 1e-9 for r, w in zip(result["row_ratio"], WEIGHTS))
              and min(result["row_cos"]) > 1 - 1e-12),
        Claim("§4 gradient methods act after the backward passes and can turn the step",
              f"PCGrad's step {result['pcgrad_turn']:.1f}° from the plain sum"),
        Claim("§3 vector_to_parameters would overwrite the weights, not their gradients",
              f"weights = the vector to {result['v2p_weights_gap']:.0e}; .grad unchanged: "
              f"{result['v2p_grad_untouched']}",
              result["v2p_weights_gap"] == 0.0 and result["v2p_grad_untouched"]),
        Claim("§3 writing into the shared .grad and leaving each head its plain gradient is "
              "the PCGrad paper's rule and how LibMTL writes back PCGrad and GradVac",
              "the write-back itself is measured above (heads keep their plain gradient)",
              reason="a statement about a paper and another library's source, which no run "
                     "of this library can measure"),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    b = result["batch"]
    for key, color, label in (("mean", "C0", "MSELoss() (mean)"),
                              ("sum", "C1", "MSELoss(reduction='sum')")):
        for n, values in zip(b["n"], b["norms"][key]):
            ax1.loglog([n] * len(values), values, ".", color=color, alpha=0.5)
        slope = b[f"slope_{key}"]
        ax1.loglog(b["n"], b["median"][key], "-", color=color,
                   label=f"{label}: median of {SEEDS} seeds, slope {slope:.2f}")
    ax1.set_xlabel("batch size n")
    ax1.set_ylabel("‖trunk gradient‖ of task 0")
    ax1.set_title("batch means do not grow with n", fontsize=10)
    ax1.legend(fontsize=8)
    ks = list(range(K))
    plain = result["head_plain"]
    weighted = [p * r for p, r in zip(plain, result["head_ratio"])]
    ax2.bar([k - 0.2 for k in ks], plain, 0.4,
            label="plain ∂(ΣL)/∂head (= the library's and the text's .grad)")
    ax2.bar([k + 0.2 for k in ks], weighted, 0.4, label="weighted losses Σ wₖLₖ")
    for k in ks:
        ax2.text(k + 0.2, weighted[k], f"× {result['head_ratio'][k]:.2f}", ha="center",
                 va="bottom", fontsize=9)
    ax2.set_xticks(ks, [f"head {k} (w = {WEIGHTS[k]})" for k in ks])
    ax2.set_yscale("log")
    ax2.set_ylim(min(plain + weighted) / 2, max(plain + weighted) * 8)
    ax2.set_ylabel("‖head gradient‖ (log)")
    ax2.set_title("each head keeps its plain gradient; weights scale it", fontsize=10)
    ax2.legend(fontsize=8, loc="upper left")
    fig.suptitle(TITLE)
    save_figure(fig, path)
