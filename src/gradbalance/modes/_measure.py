"""Choosing the task-gradient passes by measurement, once per buffer.

On a device without a measured preference (``AUTO_PREFERENCE``; a GPU, say) or with
``passes="measure"``, the first micro-batch that overwrites ``G`` computes it four times —
batched, loop, batched, loop — and the faster of the last two runs wins (the first pair
absorbs one-off costs: kernel selection, vmap set-up, allocator growth); if batched wins it
runs once more, so ``G`` is the winner's. The runs are timed with the device synchronised.
The buffer keeps the choice in its ``state_dict``, so a resumed run computes ``G`` the same
way, bit for bit.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from torch import Tensor

from ..taskgrads import ParamLayout, TaskRoots, compute_into

__all__ = ["measure_passes"]

Concrete = Literal["loop", "batched"]


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
    """Overwrite ``out`` with the task gradients, timing loop and batched; return the faster.

    ``out`` ends up holding the chosen passes's result (``reached`` as in ``compute_into``).
    A model without a batching rule costs one failed batched call (and its warning) and gets
    the loop.
    """
    if timed_run(roots, layout, out, "batched", reached) == float("inf"):
        return "loop"  # the fallback already wrote the loop's result
    seconds = [timed_run(roots, layout, out, s, reached) for s in ("loop", "batched", "loop")]
    if seconds[1] < seconds[2]:
        timed_run(roots, layout, out, "batched", reached)
        return "batched"
    return "loop"
