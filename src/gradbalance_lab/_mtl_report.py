"""Tables, Δm and plots of a comparison (CSV, markdown, text and PNG).

Δm (Maninis et al. 2019; Vandenhende et al. 2021) is the mean relative change of each task's
metric against the single-task baseline, signed so that **higher is better**::

    Δm = (1/T) Σₜ (−1)^{lₜ} (Mₜ − M_STL,ₜ) / M_STL,ₜ × 100

with ``lₜ = 1`` when a lower metric is better (the MAE of ``sum``) and ``M_STL,ₜ`` the
single-task metric averaged over seeds.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from gradbalance._optional import pyplot
from gradbalance_lab._mtl_runner import RunResult
from gradbalance_lab._mtl_timing import StepTime

__all__ = [
    "Summary",
    "delta_m",
    "format_markdown",
    "plot_results",
    "summarize",
    "write_csvs",
]


def delta_m(metrics: Sequence[float], baseline: Sequence[float],
            higher_is_better: Sequence[bool]) -> float:
    """Δm in % (higher is better) of ``metrics`` against ``baseline``, one entry per task."""
    if not (len(metrics) == len(baseline) == len(higher_is_better)):
        raise ValueError(
            f"metrics, baseline and higher_is_better must have one entry per task, got "
            f"{len(metrics)}, {len(baseline)} and {len(higher_is_better)}"
        )
    terms = []
    for m, b, up in zip(metrics, baseline, higher_is_better):
        if b == 0:
            raise ValueError("a single-task baseline metric is 0; Δm is undefined")
        sign = 1.0 if up else -1.0
        terms.append(sign * (m - b) / b)
    return 100.0 * sum(terms) / len(terms)


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    clean = [v for v in values if not math.isnan(v)]
    if not clean:
        return math.nan, math.nan
    std = statistics.stdev(clean) if len(clean) > 1 else math.nan
    return statistics.fmean(clean), std


@dataclass
class Summary:
    """Mean and std over seeds of one method (``label``), as in the tables."""

    label: str
    kind: str
    runs: int
    means: list[float]
    stds: list[float]
    delta_mean: float
    delta_std: float
    step_ms: float
    time_ratio: float
    failed: int = 0
    note: str = ""


def baseline_metrics(results: Sequence[RunResult], num_tasks: int) -> list[float] | None:
    """Per-task single-task metric averaged over seeds, or None if a task has no baseline."""
    values = []
    for t in range(num_tasks):
        runs = [r.metrics[t] for r in results if r.method.kind == "single" and r.method.task == t]
        if not runs:
            return None
        values.append(statistics.fmean(runs))
    return values


def run_delta(result: RunResult, baseline: list[float] | None,
              higher_is_better: Sequence[bool]) -> float:
    """One run's Δm; NaN (shown blank) without baselines, for a baseline itself, and where a
    baseline metric is 0 (Δm divides by it: a short run's 0 % accuracy)."""
    if baseline is None or result.method.kind == "single" or 0.0 in baseline:
        return math.nan
    return delta_m(result.metrics, baseline, higher_is_better)


def summarize(results: Sequence[RunResult], higher_is_better: Sequence[bool],
              timings: Mapping[str, StepTime] | None = None) -> list[Summary]:
    """One :class:`Summary` per method (in first-seen order), plus one for the baselines.

    The step time and its ratio to the plain step come from ``timings`` (by label, measured
    interleaved: :mod:`gradbalance_lab._mtl_timing`); a method without one gets its runs'
    own median step time and the ratio of the means to the plain runs'.
    """
    k = len(higher_is_better)
    baseline = baseline_metrics(results, k)
    labels: list[str] = []
    for r in results:
        if _label(r) not in labels:
            labels.append(_label(r))
    plain_ms = [r.step_ms for r in results if r.method.kind == "plain"]
    ref = statistics.fmean(plain_ms) if plain_ms else math.nan
    if timings and "plain" in timings and "plain" not in labels:
        # timed, not trained (it makes the same update as sum): the row before the methods
        at = next((i for i, r in enumerate(results) if r.method.kind != "single"), None)
        labels.insert(len(labels) if at is None else labels.index(_label(results[at])),
                      "plain")
    out = []
    for label in labels:
        group = [r for r in results if _label(r) == label]
        if not group:
            out.append(_timing_only(label, timings[label], k))  # type: ignore[index]
            continue
        stats = [_mean_std([r.metrics[t] for r in group]) for t in range(k)]
        deltas = [run_delta(r, baseline, higher_is_better) for r in group]
        d_mean, d_std = _mean_std(deltas)
        if group[0].method.kind == "single" and baseline is not None and 0.0 not in baseline:
            d_mean, d_std = 0.0, math.nan
        step_ms, _ = _mean_std([r.step_ms for r in group])
        kind = group[0].method.kind
        ratio = step_ms / ref if kind != "single" and not math.isnan(ref) else math.nan
        timed = (timings or {}).get(label)
        if timed is not None and kind != "single":
            step_ms, ratio = timed.ms, timed.ratio
        runs = len({r.seed for r in group})
        errors = [r.error for r in group if r.error is not None]
        note = f"{len(errors)}/{len(group)} runs failed: {errors[0]}" if errors else ""
        out.append(Summary(label, kind, runs, [s[0] for s in stats], [s[1] for s in stats],
                           d_mean, d_std, step_ms, ratio, len(errors), note))
    return out


def _label(result: RunResult) -> str:
    return "single-task" if result.method.kind == "single" else result.method.label


def _timing_only(label: str, timed: StepTime, k: int) -> Summary:
    """The row of a method timed but not trained (the plain step)."""
    nan = [math.nan] * k
    return Summary(label, "plain step", 0, nan, list(nan), math.nan, math.nan, timed.ms,
                   timed.ratio)


def _fmt(value: float, digits: int = 1) -> str:
    return "" if math.isnan(value) else f"{value:.{digits}f}"


def _pm(mean: float, std: float, digits: int = 1) -> str:
    if math.isnan(mean):
        return "–"
    return f"{mean:.{digits}f}" if math.isnan(std) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def format_markdown(summaries: Sequence[Summary], metric_names: Sequence[str],
                    higher_is_better: Sequence[bool]) -> str:
    """The comparison table in markdown (mean ± std over seeds)."""
    heads = [f"{n.replace('_acc', ' acc %').replace('_mae', ' MAE')} {'↑' if up else '↓'}"
             for n, up in zip(metric_names, higher_is_better)]
    notes = any(s.note for s in summaries)
    header = ["method", "kind", *heads, "Δm % ↑", "step ms", "× plain step"]
    header += ["notes"] if notes else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for s in summaries:
        cells = [s.label, s.kind]
        cells += [_pm(m, d, 1 if up else 2)
                  for m, d, up in zip(s.means, s.stds, higher_is_better)]
        cells.append(_pm(s.delta_mean, s.delta_std, 2))
        cells.append(_fmt(s.step_ms, 2))
        cells.append(_fmt(s.time_ratio, 2) or "–")
        if notes:
            cells.append(s.note.replace("|", "/").replace("\n", " ")[:160])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


RUN_COLUMNS = ("method", "kind", "seed")
SUMMARY_COLUMNS = ("method", "kind", "runs")


def write_csvs(out: Path, results: Sequence[RunResult], summaries: Sequence[Summary],
               metric_names: Sequence[str], task_names: Sequence[str],
               higher_is_better: Sequence[bool]) -> dict[str, Path]:
    """Write ``runs.csv``, ``history.csv`` and ``summary.csv`` into ``out``; return the paths."""
    baseline = baseline_metrics(results, len(metric_names))
    paths = {name: out / f"{name}.csv" for name in ("runs", "history", "summary")}
    with paths["runs"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*RUN_COLUMNS, *metric_names, "delta_m", "step_ms", "steps", "seconds",
                    *(f"train_loss_{t}" for t in task_names), "error"])
        for r in results:
            w.writerow([r.method.label, r.method.kind, r.seed, *map(_fmt6, r.metrics),
                        _fmt6(run_delta(r, baseline, higher_is_better)), _fmt6(r.step_ms),
                        r.steps, _fmt6(r.seconds),
                        *map(_fmt6, padded(r.train_losses, len(task_names))), r.error or ""])
    with paths["history"].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "kind", "seed", "epoch", *metric_names])
        for r in results:
            for epoch, values in enumerate(r.history, start=1):
                w.writerow([r.method.label, r.method.kind, r.seed, epoch, *map(_fmt6, values)])
    with paths["summary"].open("w", newline="") as f:
        w = csv.writer(f)
        cols = [c for n in metric_names for c in (f"{n}_mean", f"{n}_std")]
        w.writerow([*SUMMARY_COLUMNS, *cols, "delta_m_mean", "delta_m_std", "step_ms",
                    "x_plain_step", "failed", "note"])
        for s in summaries:
            vals = [v for m, d in zip(s.means, s.stds) for v in (m, d)]
            w.writerow([s.label, s.kind, s.runs, *map(_fmt6, vals), _fmt6(s.delta_mean),
                        _fmt6(s.delta_std), _fmt6(s.step_ms), _fmt6(s.time_ratio), s.failed,
                        s.note])
    return paths


def padded(values: Sequence[float], n: int) -> list[float]:
    """``values`` padded with NaN to length ``n`` (failed runs have no losses)."""
    return list(values) + [math.nan] * (n - len(values))


def _fmt6(value: float) -> str:
    return "" if math.isnan(value) else f"{value:.6g}"


def plot_results(path: Path, results: Sequence[RunResult], summaries: Sequence[Summary],
                 metric_names: Sequence[str]) -> Path:
    """Test metric per epoch for each task (mean over seeds) and the Δm / time bars."""
    plt = pyplot("the comparison plot")
    k = len(metric_names)
    labels: list[str] = []
    for r in results:
        if r.method.label not in labels and r.method.kind != "single":
            labels.append(r.method.label)
    rows = [s for s in summaries if s.kind != "single"]
    height = max(3.6, 0.22 * len(rows) + 1.2)
    fig, axes = plt.subplots(1, k + 2, figsize=(4.0 * (k + 2), height))
    cmap = plt.get_cmap("tab20")
    styles = ("-", "--", ":", "-.")
    for t, ax in enumerate(axes[:k]):
        singles = [r for r in results if r.method.kind == "single" and r.method.task == t
                   and r.history]
        if singles:
            curve = _mean_curve(singles, t)
            ax.plot(range(1, len(curve) + 1), curve, color="k", linewidth=2.2,
                    label="single-task")
        for i, label in enumerate(labels):
            group = [r for r in results if r.method.label == label and r.history]
            if not group:
                continue
            curve = _mean_curve(group, t)
            ax.plot(range(1, len(curve) + 1), curve, color=cmap(i % 20),
                    linestyle=styles[(i // 20) % 4], linewidth=1.2, label=label)
        ax.set_title(f"test {metric_names[t]} (mean over seeds)", fontsize=9)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    names_y = [s.label for s in rows][::-1]
    ax = axes[k]
    deltas = [s.delta_mean for s in rows][::-1]
    if any(not math.isnan(d) for d in deltas):
        errs = [0.0 if math.isnan(s.delta_std) else s.delta_std for s in rows][::-1]
        ax.barh(names_y, [0.0 if math.isnan(d) else d for d in deltas], xerr=errs, capsize=2,
                color=["tab:green" if d >= 0 else "tab:red" for d in deltas])
        ax.axvline(0, color="k", linewidth=0.8)
        for y, (row, d) in enumerate(zip(rows[::-1], deltas)):
            if math.isnan(d):
                what = "timed only" if row.runs == 0 else "failed"
                ax.text(0, y, f" {row.label}: {what}", va="center", fontsize=7,
                        color="tab:gray" if row.runs == 0 else "tab:red")
        ax.set_title("Δm % vs single-task (higher is better)", fontsize=9)
    else:
        ax.set_title("Δm: no single-task baselines", fontsize=9)
    ax = axes[k + 1]
    ax.barh(names_y, [0.0 if math.isnan(s.time_ratio) else s.time_ratio for s in rows][::-1],
            color="tab:gray")
    ax.axvline(1, color="k", linewidth=0.8)
    ax.set_title("step time × plain step (sum().backward())", fontsize=9)
    for ax in axes[k:]:
        ax.tick_params(axis="y", labelsize=7)
    fig.legend(handles, names, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _mean_curve(group: Sequence[RunResult], task: int) -> list[float]:
    epochs = min(len(r.history) for r in group)
    return [statistics.fmean(r.history[e][task] for r in group) for e in range(epochs)]
