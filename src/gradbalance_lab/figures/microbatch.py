"""§12 Micro-batches: balance the averaged gradient once, or balance each and average.

Setting (the two orders): the two-bowl example of :mod:`._common`, evaluated at points drawn
uniformly from the square [−2, 5]² around both minima, 2,000 points per seed (400 with
``--quick``) and 5 seeds. The text names no region of points: the square is a choice, and
the square [0, 3]² spanned by the two minima is run beside it as sensitivity (the medians
move with it). At each point, 4 micro-batches; micro-batch ``j`` gives task ``k`` its exact
gradient plus Gaussian noise ``ξⱼₖ``.

"Gradient noise about as large as the gradient" is read, fixed before measuring, as noise on
each **micro-batch** (the gradients the "balance each" order is handed) with the **same**
scale for both tasks, standard deviation ``‖G‖_F / 2`` per coordinate, so that
``E‖ξ‖² = (‖g₁‖² + ‖g₂‖²)/2``: the two-bowl example's batch noise (§8.2, :mod:`._common`)
has one distribution for both tasks. Both of the section's numbers are judged under that
reading only. The three other readings are shown as sensitivity, never as a second chance:
noise on the **averaged** gradient (each micro-batch's noise √4 = 2 times larger, so that
the mean of the 4 has that size), and a scale **per task** (``‖gₖ‖/√2`` per coordinate, so
``E‖ξₖ‖² = ‖gₖ‖²``).

The angle between ``B(mean of parts)`` and ``mean of B(part)`` is computed with the batched
two-task ``PCGrad`` and ``MGDA`` (no normalisation) of :mod:`._common`; the median per seed
is reported, and the number is met when the range of the 5 seed medians overlaps it as the
text rounds it (7° means 6.5–7.5°). The reading is also run
through the library on 100 points (:class:`~gradbalance.TaskGradBuffer`: ``backward(losses_j
/ 4)`` for every ``j`` then one ``apply_``; and ``backward(losses_j)`` + ``apply_`` per
micro-batch, averaged) as the check of the batched form; a linear balancer (``Mean``) is the
control: its two orders agree to rounding.

Setting (full batch): a 3-task regression model (MLP trunk 8→16→16, linear heads), a batch
of 64 split into 4 micro-batches of 16, losses as batch means (float64). Averaging first
(:class:`~gradbalance.TaskGradBuffer`, ``backward(losses_j / 4)`` four times) against the full
batch's ``task_gradients`` and its balanced step (``PCGrad`` with the same seed, ``MGDA``),
trunk and heads; balancing each micro-batch (:class:`gradbalance_lab.microbatch.BalanceEach`)
is the contrast.

Balancing is not linear (the hand-derived case): ``A`` with the rows ``(1, 0)``, ``(0, 1)``
(no conflict) and ``C`` with ``(1, 0)``, ``(−1, 0)`` (exactly opposed). By hand, ``PCGrad``
(sum of the projected rows) gives ``(1, 1)`` on ``A``, ``0`` on ``C`` and on ``A + C``
(rows ``(2, 0)``, ``(−1, 1)``, dot −2) ``1.5·(2, 0) + 2·(−1, 1) = (1, 2)``; ``MGDA`` (the
min-norm point ``γ g₁ + (1 − γ) g₂``) gives ``(0.5, 0.5)``, ``0`` and, with
``γ = (2 + 2)/(4 + 4 + 2) = 0.4``, ``(0.2, 0.6)``; ``Mean`` gives ``(0.5, 0.5)`` both ways.
The library's balancers are run on the three matrices; met when every value matches the hand
values and ``PCGrad`` and ``MGDA`` break additivity while ``Mean`` keeps it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import Balancer, get_balancer
from gradbalance.step import TaskGradBuffer, balanced_backward
from gradbalance.taskgrads import task_gradients
from gradbalance_lab.figures._common import (
    KERNELS,
    Claim,
    TwoBowls,
    angle_deg,
    angles_deg,
    bowl_gradients,
    grad_of,
    pyplot,
    require_balancer,
    save_figure,
    seed_range,
)
from gradbalance_lab.microbatch import BalanceEach
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "microbatch"
TITLE = "§12 Micro-batches: the two orders of balancing"
PARTS = 4
LOW, HIGH = -2.0, 5.0
#: the square of the sensitivity run: the one spanned by the two minima
SPAN = (0.0, 3.0)
SEED_NUMBERS = {"pcgrad": 7.0, "mgda": 19.0}
LABELS = {"pcgrad": "PCGrad", "mgda": "MGDA"}
SEEDS = 5
#: (where the noise is as large as the gradient, its scale across tasks)
READINGS = (("micro-batch", "same"), ("micro-batch", "per task"),
            ("averaged", "same"), ("averaged", "per task"))
#: the reading every number of the section is judged under (the others are sensitivity)
READING = READINGS[0]
CHECK_POINTS = 100


def _reading(where: str, scale: str) -> str:
    return f"noise on each {where}, {scale} scale" if where == "micro-batch" else (
        f"noise on the averaged gradient, {scale} scale")


def _draw(seed: int, n: int, box: tuple[float, float] = (LOW, HIGH)
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Points ``[n, 2]`` uniform in the square ``box``² and standard normal draws
    ``[n, PARTS, 2, 2]`` for one seed."""
    gen = torch.Generator().manual_seed(seed)
    low, high = box
    points = torch.rand(n, 2, generator=gen, dtype=torch.float64) * (high - low) + low
    return points, torch.randn(n, PARTS, 2, 2, generator=gen, dtype=torch.float64)


def _noise(exact: torch.Tensor, unit: torch.Tensor, where: str, scale: str) -> torch.Tensor:
    """The noise of one reading: ``unit`` ``[n, PARTS, 2, 2]`` times its standard deviation."""
    if scale == "same":
        sigma = (exact.norm(dim=(-2, -1)) / 2)[:, None, None, None]
    else:
        sigma = (exact.norm(dim=-1) / 2**0.5)[:, None, :, None]
    if where == "averaged":
        sigma = sigma * PARTS**0.5
    out: torch.Tensor = unit * sigma
    return out


def _orders(name: str, parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = KERNELS[name]
    return kernel(parts.mean(dim=1)), kernel(parts).mean(dim=1)


def library_orders(balancer: Balancer, point: torch.Tensor,
                   noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(balance once, balance each then average) through the library at ``point``, with the
    micro-batches' noise ``noise`` ``[PARTS, 2, 2]``."""
    bowls = TwoBowls()
    w = bowls.weights
    with torch.no_grad():
        w.copy_(point)
    buf = TaskGradBuffer([w], num_tasks=2)
    for xi in noise:
        buf.backward(bowls.losses(xi=xi) / PARTS)
    buf.apply_(balancer)
    once = grad_of(w).clone()
    w.grad = None
    for xi in noise:
        buf.backward(bowls.losses(xi=xi))
        buf.apply_(balancer)
    each = grad_of(w).clone() / PARTS
    w.grad = None
    return once, each


def _full_batch() -> dict[str, Any]:
    """Averaging 4 micro-batches first against the full batch, on a real model (float64)."""
    torch.manual_seed(0)
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, 3)).double()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(64, 3, generator=gen, dtype=torch.float64) * torch.tensor(
        [1.0, 10.0, 0.1], dtype=torch.float64)
    shared, heads = model.shared_parameters(), model.head_parameters()

    def grads() -> torch.Tensor:
        out = torch.cat([grad_of(p).reshape(-1) for p in [*shared, *heads]])
        model.zero_grad(set_to_none=True)
        return out

    full = task_gradients(regression_losses(model(x), y), shared)
    result: dict[str, Any] = {}
    for name in ("pcgrad", "mgda"):
        torch.manual_seed(5)
        balanced_backward(regression_losses(model(x), y), get_balancer(name),
                          shared_params=shared, head_params=heads)
        reference = grads()
        torch.manual_seed(5)
        balancer = get_balancer(name)
        buf = TaskGradBuffer(shared, heads)
        for xs, ys in zip(x.chunk(PARTS), y.chunk(PARTS)):
            buf.backward(regression_losses(model(xs), ys) / PARTS)
        matrix = buf.matrix
        assert matrix is not None
        result["matrix_gap"] = float((matrix - full).norm() / full.norm())
        buf.apply_(balancer)
        once = grads()
        torch.manual_seed(5)
        balancer = get_balancer(name)
        each_buf = BalanceEach(shared, heads, num_microbatches=PARTS)
        for xs, ys in zip(x.chunk(PARTS), y.chunk(PARTS)):
            each_buf.backward(regression_losses(model(xs), ys), balancer)
        each = grads()
        result[name] = {"once_gap": float((once - reference).norm() / reference.norm()),
                        "each_angle": angle_deg(each, reference)}
    return result


def compute(quick: bool = False) -> dict[str, Any]:
    n = 400 if quick else 2000
    for name in SEED_NUMBERS:
        require_balancer(name)
    medians: dict[str, dict[str, list[float]]] = {}
    angles: dict[str, dict[str, list[float]]] = {}
    for where, scale in READINGS:
        key = f"{where}/{scale}"
        medians[key] = {name: [] for name in SEED_NUMBERS}
        for seed in range(SEEDS):
            points, unit = _draw(seed, n)
            exact = bowl_gradients(points)
            parts = exact.unsqueeze(1) + _noise(exact, unit, where, scale)
            for name in SEED_NUMBERS:
                once, each = _orders(name, parts)
                a = angles_deg(once, each)
                medians[key][name].append(float(a.median()))
                if seed == 0:
                    angles.setdefault(key, {})[name] = a.tolist()
    span: dict[str, list[float]] = {name: [] for name in SEED_NUMBERS}
    for seed in range(SEEDS):
        points, unit = _draw(seed, n, SPAN)
        exact = bowl_gradients(points)
        parts = exact.unsqueeze(1) + _noise(exact, unit, *READING)
        for name in SEED_NUMBERS:
            span[name].append(float(angles_deg(*_orders(name, parts)).median()))
    # The check: the reading's first points through the library.
    points, unit = _draw(0, CHECK_POINTS)
    exact = bowl_gradients(points)
    noise = _noise(exact, unit, *READING)
    gap = 0.0
    for name in SEED_NUMBERS:
        once, each = _orders(name, exact.unsqueeze(1) + noise)
        balancer = require_balancer(name)
        for i in range(CHECK_POINTS):
            lib_once, lib_each = library_orders(balancer, points[i], noise[i])
            size = float(exact[i].norm())
            gap = max(gap, float((lib_once - once[i]).norm()) / size,
                      float((lib_each - each[i]).norm()) / size)
    control = max(angle_deg(*library_orders(get_balancer("mean"), points[i], noise[i]))
                  for i in range(50))
    return {"points": n, "seeds": SEEDS, "medians": medians, "angles": angles, "span": span,
            "median": {name: _median(angles["/".join(READING)][name])
                       for name in SEED_NUMBERS},
            "library_gap": gap, "check_points": CHECK_POINTS, "control_max": control,
            "full_batch": _full_batch(), "not_linear": not_linear()}


#: the hand-derived case of "balancing is not linear": B(A + C) against B(A) + B(C)
LINEAR_CASE = {"A": ((1.0, 0.0), (0.0, 1.0)), "C": ((1.0, 0.0), (-1.0, 0.0))}
#: (B(A + C), B(A) + B(C)) by hand, see the module's docstring
BY_HAND = {"pcgrad": ((1.0, 2.0), (1.0, 1.0)), "mgda": ((0.2, 0.6), (0.5, 0.5)),
           "mean": ((0.5, 0.5), (0.5, 0.5))}


def not_linear() -> dict[str, dict[str, Any]]:
    """The library's balancers on ``A``, ``C`` and ``A + C``: both sides, and their gaps to
    the values by hand."""
    a, c = (torch.tensor(LINEAR_CASE[k], dtype=torch.float64) for k in ("A", "C"))
    out = {}
    for name, (whole, parts) in BY_HAND.items():
        balancer = require_balancer(name)
        left, right = balancer(a + c), balancer(a) + balancer(c)
        out[name] = {"left": left.tolist(), "right": right.tolist(),
                     "gap": float((left - right).norm()),
                     "hand_gap": max(float((left - torch.tensor(whole, dtype=torch.float64))
                                           .norm()),
                                     float((right - torch.tensor(parts, dtype=torch.float64))
                                           .norm()))}
    return out


def _median(values: list[float]) -> float:
    return float(torch.tensor(values).median())


def _pair(v: list[float]) -> str:
    return f"({v[0]:.6g}, {v[1]:.6g})"


def _ranges(medians: dict[str, list[float]]) -> str:
    return "; ".join(f"{LABELS[k]} {min(v):.1f}–{max(v):.1f}°" for k, v in medians.items())


def claims(result: dict[str, Any]) -> list[Claim]:
    out = []
    n, seeds = result["points"], result["seeds"]
    fixed = result["medians"]["/".join(READING)]
    for name, target in SEED_NUMBERS.items():
        lo, hi, met = seed_range(fixed[name], target)
        elsewhere = [_reading(where, scale) for where, scale in READINGS
                     if (where, scale) != READING
                     and seed_range(result["medians"][f"{where}/{scale}"][name], target)[2]]
        note = "" if met else (
            f"; not reproduced under the reading fixed for the section (only under: "
            f"{', '.join(elsewhere)}, a sensitivity reading)" if elsewhere else
            "; no reading of the four reproduces it")
        out.append(Claim(
            f"§12 the two orders give steps about {target:.0f}° apart for {LABELS[name]} "
            f"(median, two-bowl example, 4 micro-batches, noise about as large as the "
            f"gradient, read as: {_reading(*READING)})",
            f"seed medians {lo:.1f}–{hi:.1f}° ({seeds} seeds × {n} points in [{LOW:g}, "
            f"{HIGH:g}]²); the text's {target:.0f}° as it rounds it: {target - 0.5:g}–"
            f"{target + 0.5:g}°{note}", met))
    others = [f"{_reading(where, scale)}: {_ranges(result['medians'][f'{where}/{scale}'])}"
              for where, scale in READINGS if (where, scale) != READING]
    out.append(Claim("§12 (sensitivity) the other readings of 'noise about as large as the "
                     "gradient', not used for the verdicts", "; ".join(others)))
    out.append(Claim(f"§12 (sensitivity) points in [{SPAN[0]:g}, {SPAN[1]:g}]², the square "
                     f"spanned by the two minima, instead of [{LOW:g}, {HIGH:g}]² (the text "
                     f"names no region)", _ranges(result["span"])))
    fb = result["full_batch"]
    out.append(Claim(
        "§12 averaging first and balancing once gives the balancer the same gradients a full "
        "batch would (4 micro-batches of 16 against one batch of 64)",
        f"G to {fb['matrix_gap']:.0e}; balanced step (trunk and heads) to "
        f"{fb['pcgrad']['once_gap']:.0e} (PCGrad), {fb['mgda']['once_gap']:.0e} (MGDA); "
        f"balancing each instead: {fb['pcgrad']['each_angle']:.1f}° (PCGrad), "
        f"{fb['mgda']['each_angle']:.1f}° (MGDA) from the full-batch step",
        fb["matrix_gap"] < 1e-12 and fb["pcgrad"]["once_gap"] < 1e-12
        and fb["mgda"]["once_gap"] < 1e-12))
    lin = result["not_linear"]
    out.append(Claim(
        "§12 balancing is not linear: B(A + C) ≠ B(A) + B(C), with Mean as the linear control",
        "; ".join(f"{LABELS.get(k, 'Mean')}: B(A + C) = {_pair(v['left'])}, B(A) + B(C) = "
                  f"{_pair(v['right'])} (by hand to {v['hand_gap']:.0e})"
                  for k, v in lin.items()),
        all(v["hand_gap"] < 1e-12 for v in lin.values()) and lin["mean"]["gap"] < 1e-12
        and min(lin["pcgrad"]["gap"], lin["mgda"]["gap"]) > 0.1))
    out.append(Claim("§12 control: a linear balancer (Mean) gives the same step in both orders",
                     f"largest angle {result['control_max']:.1e}°",
                     result["control_max"] < 1e-4))
    out.append(Claim("§12 (check) the batched two orders are the library's",
                     f"TaskGradBuffer + PCGrad / MGDA on {result['check_points']} points to "
                     f"{result['library_gap']:.0e} of ‖G‖", result["library_gap"] < 1e-12))
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5.2),
                                   gridspec_kw={"width_ratios": [1.15, 1]})
    ys = list(range(len(READINGS)))
    for j, (name, marker) in enumerate((("pcgrad", "o"), ("mgda", "s"))):
        color = f"C{j}"
        target = SEED_NUMBERS[name]
        ax1.axvspan(target - 0.5, target + 0.5, color=color, alpha=0.15)
        ax1.axvline(target, color=color, ls=":", lw=1)
        ax1.text(target + 0.7, -0.45, f"text: {target:.0f}° (±0.5)", color=color,
                 ha="left", va="center", fontsize=9)
        for y, (where, scale) in zip(ys, READINGS):
            med = result["medians"][f"{where}/{scale}"][name]
            lo, hi = min(med), max(med)
            mid = sum(med) / len(med)
            ax1.errorbar([mid], [y + (0.12 if j else -0.12)], xerr=[[mid - lo], [hi - mid]],
                         fmt=marker, color=color, capsize=4,
                         label=f"{LABELS[name]}: seed medians (min–max)" if y == 0 else None)
    ax1.set_yticks(ys, [("USED: " if (w, s) == READING else "")
                        + _reading(w, s).replace(", ", ",\n") for w, s in READINGS], fontsize=8)
    ax1.set_ylim(-0.7, len(READINGS) - 0.3)
    ax1.invert_yaxis()
    ax1.set_xlabel("median angle between the two orders (°)")
    ax1.set_ylabel("reading of 'noise about as large as the gradient'", fontsize=9)
    ax1.set_title("the reading used (top) and three others as sensitivity", fontsize=10)
    ax1.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    bins = [i * 3.0 for i in range(61)]
    for name, color in (("pcgrad", "C0"), ("mgda", "C1")):
        values = result["angles"]["/".join(READING)][name]
        med = _median(values)
        ax2.hist(values, bins=bins, alpha=0.5, color=color,
                 label=f"{LABELS[name]}: median {med:.1f}° (text {SEED_NUMBERS[name]:.0f}°)")
        ax2.axvline(med, color=color, ls="--")
    ax2.set_xlabel("angle between 'average then balance' and 'balance then average' (°)")
    ax2.set_ylabel(f"points (seed 0, of {result['points']})")
    ax2.set_title("angles at each point, under the reading used", fontsize=10)
    ax2.legend(fontsize=7)
    fig.suptitle(TITLE)
    save_figure(fig, path)
