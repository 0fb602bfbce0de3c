"""The outputs of a comparison, written the same way by ``gradbalance compare``/``train`` and
by :func:`gradbalance_lab.compare.compare`: ``summary.md``, the CSVs, ``config.json``, the
plot and the TensorBoard summary."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradbalance_lab._mtl_report import (
    Summary,
    format_markdown,
    plot_results,
    summarize,
    write_csvs,
)
from gradbalance_lab._mtl_runner import RunResult, open_writer
from gradbalance_lab._mtl_timing import StepTime

__all__ = ["Tasks", "Written", "write_report"]


@dataclass(frozen=True)
class Tasks:
    """What the tables say about the tasks: names, metric names and their directions."""

    task_names: tuple[str, ...]
    metric_names: tuple[str, ...]
    higher_is_better: tuple[bool, ...]


@dataclass(frozen=True)
class Written:
    """The summaries, the markdown table and the paths written."""

    summaries: list[Summary]
    table: str
    paths: list[Path]


def write_report(out: Path, results: Sequence[RunResult], timings: Mapping[str, StepTime],
                 tasks: Tasks, config: Mapping[str, Any], *, title: str, plot: str | None,
                 tensorboard: bool) -> Written:
    """Tables, config, plot (``plot``: its file name, None for none) and TensorBoard summary
    of ``results`` into ``out``."""
    hib = tasks.higher_is_better
    summaries = summarize(results, hib, timings)
    table = format_markdown(summaries, tasks.metric_names, hib)
    paths = write_csvs(out, results, summaries, tasks.metric_names, tasks.task_names, hib)
    (out / "summary.md").write_text(f"# {title}\n\n{table}")
    (out / "config.json").write_text(json.dumps(
        {k: str(v) if isinstance(v, Path) else v for k, v in config.items()
         if not k.startswith("_")}, indent=2, default=str) + "\n")
    written = [out / "summary.md", *paths.values(), out / "config.json"]
    if plot is not None and results:
        written.append(plot_results(out / plot, results, summaries, tasks.metric_names))
    if tensorboard:
        writer = open_writer(out / "tb" / "summary")
        writer.add_text("summary", table)
        writer.close()
        written.append(out / "tb")
    return Written(summaries, table, written)
