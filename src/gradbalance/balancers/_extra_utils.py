"""Small helpers shared by the stochastic, stateful and robust balancers.

Not a balancer module (no ``__all__``): simplex projection, argument checks in the house
style, generator state and state-dict plumbing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor


def project_simplex(v: Tensor) -> Tensor:
    """Euclidean projection of ``v`` ``[K]`` onto the probability simplex (sort-based, exact).

    ``argmin_{w ≥ 0, Σw = 1} ‖w − v‖``: ``w = max(v − θ, 0)`` with ``θ`` from the sorted
    cumulative sums (Held, Wolfe & Crowder 1974; Duchi et al. 2008).
    """
    k = v.shape[0]
    u, _ = torch.sort(v, descending=True)
    css = torch.cumsum(u, dim=0) - 1.0
    idx = torch.arange(1, k + 1, dtype=v.dtype, device=v.device)
    cond = u - css / idx > 0
    rho = int(torch.nonzero(cond).max()) if bool(cond.any()) else 0
    theta = css[rho] / (rho + 1)
    return (v - theta).clamp_min(0)


def check_range(name: str, value: float, low: float | None, high: float | None,
                low_open: bool = False, high_open: bool = False) -> float:
    """Validate a float hyper-parameter; ``ValueError`` in the house style otherwise."""
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


def check_generator(generator: torch.Generator | None) -> torch.Generator | None:
    """Accept ``None`` (torch's global RNG) or a ``torch.Generator``."""
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(
            f"Invalid generator: {type(generator).__name__} (expected a torch.Generator or None, "
            f"e.g. torch.Generator().manual_seed(0))"
        )
    return generator


def generator_state(generator: torch.Generator | None) -> dict[str, Tensor]:
    """``{"generator": state}`` for a held generator, else empty."""
    return {} if generator is None else {"generator": generator.get_state().clone()}


def restore_generator(generator: torch.Generator | None, state: dict[str, Any],
                      owner: str) -> None:
    """Restore a generator state saved by :func:`generator_state`."""
    if "generator" not in state:
        return
    if generator is None:
        raise ValueError(
            f"state_dict holds a generator state but this {owner} has no generator; build it "
            f"with generator=torch.Generator() to resume the same random stream"
        )
    generator.set_state(state["generator"].clone())


def check_keys(owner: str, state: dict[str, Any], allowed: Iterable[str]) -> None:
    """Reject unknown keys (a state saved from another balancer)."""
    extra = sorted(set(state) - set(allowed))
    if extra:
        raise ValueError(
            f"state_dict has unexpected keys {extra} for {owner} (expected a subset of "
            f"{sorted(allowed)}); was it saved from another balancer?"
        )


def clone_or_none(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.detach().clone()


def check_state_rows(owner: str, state: Tensor | None, matrix: Tensor) -> None:
    """Stateful matrix balancers: the input must match the shape of the tracked state."""
    if state is None:
        return
    if state.shape != matrix.shape:
        raise ValueError(
            f"matrix has shape {tuple(matrix.shape)} but {owner} tracks state of shape "
            f"{tuple(state.shape)} from earlier calls; pass the same tasks and parameters every "
            f"step, or call reset() first"
        )


def check_state_tasks(owner: str, state: Tensor | None, k: int) -> None:
    """Stateful weighted balancers: the number of tasks must match the tracked weights."""
    if state is not None and state.shape[0] != k:
        raise ValueError(
            f"got {k} tasks but {owner} tracks weights for {state.shape[0]} tasks from earlier "
            f"calls; pass the same tasks every step, or call reset() first"
        )
