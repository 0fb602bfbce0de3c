"""Step times of a comparison, interleaved: every method and seed in every round.

A run's own step times are taken minutes apart from another method's, so a noisy stretch of
the machine would show as a method being faster. Here each (method, seed) gets a fresh model
and one fixed batch, and each round takes one step of every one of them, the methods in a
rotated order; a method's time is the median over rounds and seeds of its step time divided
by the plain step's (``losses.sum().backward()``, same seed, same round), as
``benchmarks/step_overhead.py`` does (docs/compare.md).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["StepTime", "time_interleaved"]

#: What a timed step may raise and still leave the others timed (a solver failing).
STEP_ERRORS = (RuntimeError, ValueError, ArithmeticError)


@dataclass(frozen=True)
class StepTime:
    """A method's step: median milliseconds and median ratio to the plain step."""

    ms: float
    ratio: float


def _rounds(steps: dict[tuple[str, int], Callable[[], None]], labels: Sequence[str],
            seeds: Sequence[int], rounds: int, warmup: int) -> dict[tuple[str, int], list[float]]:
    """Seconds of each (label, seed) step per timed round (``[]`` once a step raised)."""
    times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    failed: set[tuple[str, int]] = set()
    for r in range(warmup + rounds):
        shift = r % len(labels)
        for seed in seeds:
            for label in [*labels[shift:], *labels[:shift]]:
                key = (label, seed)
                if key in failed:
                    continue
                start = time.perf_counter()
                try:
                    steps[key]()
                except STEP_ERRORS:
                    failed.add(key)
                    times[key] = []
                    continue
                if r >= warmup:
                    times[key].append(time.perf_counter() - start)
    return times


def time_interleaved(make_step: Callable[[str, int], Callable[[], None]],
                     labels: Sequence[str], seeds: Sequence[int], *, reference: str,
                     rounds: int = 20, warmup: int = 3) -> dict[str, StepTime]:
    """Time one step of every label and seed, interleaved (see the module docstring).

    ``make_step(label, seed)`` builds the step (a model, its optimizer, one batch);
    ``reference`` is the label of the plain step. A label whose step raises, or whose
    reference did, gets NaN.
    """
    if reference not in labels:
        raise ValueError(f"Invalid reference: {reference!r} is not among the timed labels "
                         f"{list(labels)}")
    steps = {(label, seed): make_step(label, seed) for seed in seeds for label in labels}
    times = _rounds(steps, labels, seeds, rounds, warmup)
    out = {}
    for label in labels:
        own = [t for seed in seeds for t in times[label, seed]]
        ratios = [t / base for seed in seeds if times[label, seed] and times[reference, seed]
                  for t, base in zip(times[label, seed], times[reference, seed])]
        out[label] = StepTime(1000.0 * statistics.median(own) if own else math.nan,
                              statistics.median(ratios) if ratios else math.nan)
    return out
