"""Choosing the task-gradient passes by measurement, once per buffer (docs/performance.md,
"Modes")."""

from __future__ import annotations

import time

import torch
from torch import Tensor

from ..taskgrads import Concrete, ParamLayout, TaskRoots, compute_into

__all__ = ["measure_passes"]


def _synchronize(device: torch.device) -> None:
    if device.type != "cpu" and hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize()


def timed_run(roots: TaskRoots, layout: ParamLayout, out: Tensor, passes: Concrete,
              reached: list[bool] | None = None) -> float:
    """Seconds for one overwrite of ``out`` with ``passes``; inf if batching fails."""
    _synchronize(layout.device)
    start = time.perf_counter()
    used = compute_into(roots, layout, out, passes="measure", preferred=passes,
                        retain_graph=True, reached=reached)
    _synchronize(layout.device)
    return time.perf_counter() - start if used == passes else float("inf")


def measure_passes(roots: TaskRoots, layout: ParamLayout, out: Tensor,
                   reached: list[bool] | None = None) -> Concrete:
    """Overwrite ``out`` with the task gradients, timing loop and batched; return the faster
    (whose result ``out`` holds). A failed batched call gives the loop at once."""
    if timed_run(roots, layout, out, "batched", reached) == float("inf"):
        return "loop"  # the fallback already wrote the loop's result
    seconds = [timed_run(roots, layout, out, s, reached) for s in ("loop", "batched", "loop")]
    if seconds[1] < seconds[2]:
        timed_run(roots, layout, out, "batched", reached)
        return "batched"
    return "loop"
