"""Argument checks of the balancers' constructors, in the house error style.

Not a balancer module (no ``__all__``). Every message names the argument, the value found and
what is expected: ``Invalid beta: 1.5 (expected 0.0 <= beta < 1.0)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def check_range(name: str, value: float, low: float | None, high: float | None,
                low_open: bool = False, high_open: bool = False) -> float:
    """Validate a float hyper-parameter in ``[low, high]`` (open ends on request)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and value == value  # not NaN
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        left = "" if low is None else f"{low} {'<' if low_open else '<='} "
        right = "" if high is None else f" {'<' if high_open else '<='} {high}"
        raise ValueError(f"Invalid {name}: {value!r} (expected {left}{name}{right})")
    return float(value)


def check_int(name: str, value: int, low: int) -> int:
    """Validate an integer hyper-parameter ``>= low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Invalid {name}: {value!r} (expected an int >= {low})")
    return value


def as_task_vector(name: str, value: Sequence[float] | Tensor, num_tasks: int | None = None,
                   low: float | None = None, high: float | None = None) -> Tensor:
    """One finite number per task ``[K]`` (float64 copy), optionally within ``[low, high]``.

    With ``num_tasks`` the length must be ``K``. Used for per-task settings given at
    construction (fixed weights, leaks, preference vectors).
    """
    vec = torch.as_tensor(value, dtype=torch.float64).detach().clone()
    if vec.dim() != 1 or vec.numel() == 0:
        raise ValueError(
            f"Invalid {name}: shape {tuple(vec.shape)} (expected a 1-D list of K numbers)"
        )
    ok = bool(torch.isfinite(vec).all())
    if ok and low is not None:
        ok = bool((vec >= low).all())
    if ok and high is not None:
        ok = bool((vec <= high).all())
    if not ok:
        left = "" if low is None else f"{low} <= "
        right = "" if high is None else f" <= {high}"
        bounds = f"{left}{name}{right}" if left or right else "finite numbers"
        raise ValueError(f"Invalid {name}: {vec.tolist()} (expected {bounds})")
    if num_tasks is not None and vec.numel() != num_tasks:
        raise ValueError(
            f"Invalid {name}: {vec.numel()} values but num_tasks={num_tasks} (expected one "
            f"per task)"
        )
    return vec


def as_pref(pref: object) -> Tensor | None:
    """Validate a preference vector given at construction (shape only; length at call time)."""
    if pref is None:
        return None
    vec = torch.as_tensor(pref, dtype=torch.float64).detach().clone().reshape(-1)
    if vec.numel() == 0 or not bool(torch.isfinite(vec).all()) or bool((vec < 0).any()):
        raise ValueError(f"Invalid pref: {vec.tolist()} (expected K finite numbers >= 0)")
    return vec


def check_pref(pref: Tensor | None, k: int, default: float) -> Tensor:
    """A preference vector ``[K]`` (float64, CPU, finite, non-negative); ``default`` if None."""
    if pref is None:
        return torch.full((k,), default, dtype=torch.float64)
    if pref.numel() != k:
        raise ValueError(
            f"Invalid pref: {pref.numel()} entries for {k} tasks (expected one entry per task)"
        )
    vec = pref.detach().to(device="cpu", dtype=torch.float64).reshape(-1)
    if not bool(torch.isfinite(vec).all()) or bool((vec < 0).any()):
        raise ValueError(f"Invalid pref: {vec.tolist()} (expected finite numbers >= 0)")
    return vec
