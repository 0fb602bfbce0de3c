"""Method names for ``compare``/``train``: parsing, validation and construction.

A *method* is the plain step (``losses.sum().backward()``, no balancing: the time reference),
a gradient balancer (``gradbalance.BALANCERS``), a loss weighting (``gradbalance.WEIGHTINGS``,
run through its one-pass path ``weighting(losses).sum().backward()``), or a single-task
baseline (one model per task, trained on that task alone; the reference of Δm).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradbalance.balancers import BALANCERS, Balancer

__all__ = [
    "DEFAULT_BALANCERS",
    "DEFAULT_WEIGHTINGS",
    "PER_SAMPLE",
    "PLAIN",
    "Method",
    "available_weightings",
    "build_balancer",
    "build_weighting",
    "build_weighting_from",
    "required_arguments",
    "resolve_methods",
    "resolve_names",
    "runnable",
]

#: The representative set ``compare`` runs by default (those missing at run time are skipped).
DEFAULT_BALANCERS = ("sum", "pcgrad", "mgda", "cagrad", "imtlg", "nashmtl", "upgrad")
DEFAULT_WEIGHTINGS = ("gradnorm", "uncertainty")

#: The kind of a balancer run over per-sample objectives (``gradbalance compare --per-sample``).
PER_SAMPLE = "per-sample"


@dataclass(frozen=True)
class Method:
    """One row of the comparison.

    ``kind`` is ``"plain"``, ``"balancer"``, ``"weighting"``, ``"single"`` or
    ``"per-sample"`` (a balancer over the per-sample losses, ``compare --per-sample``); ``key``
    is the registry name (``"plain"`` for the plain step; for ``single``, the task name) and
    ``task`` the task index of a single-task baseline.
    """

    kind: str
    key: str
    task: int | None = None
    optional: bool = False  # chosen by default or by 'all': skipped (with a warning) if unusable

    @property
    def label(self) -> str:
        if self.kind == PER_SAMPLE:
            return f"{self.key}-per-sample"
        return f"single-{self.key}" if self.kind == "single" else self.key


#: The plain step: ``losses.sum().backward()`` without the library.
PLAIN = Method("plain", "plain")


def resolve_names(names: Sequence[str], option: str = "methods") -> list[Method]:
    """``names`` (``"plain"``, balancer or loss-weighting names, in any order) as methods,
    the plain step first whether named or not; an unknown or unbuildable name raises a
    ValueError naming ``option`` and the valid names."""
    if isinstance(names, str):
        raise TypeError(f"Invalid {option}: the string {names!r} (expected a list of names, "
                        f"e.g. ['mgda', 'uncertainty'])")
    weightings = available_weightings()
    kinds = {_norm(key): "balancer" for key in BALANCERS}
    kinds.update({_norm(key): "weighting" for key in weightings})
    methods = [PLAIN]
    for name in names:
        if _norm(name) == "plain":
            continue
        kind = kinds.get(_norm(name))
        if kind is None:
            valid = ", ".join(["plain", *sorted(BALANCERS), *sorted(weightings)])
            raise ValueError(f"Unknown method {name!r} in {option}; valid names: {valid}")
        registry = BALANCERS if kind == "balancer" else weightings
        key = _lookup([name], registry, kind, option, None)[0]
        if Method(kind, key) not in methods:
            methods.append(Method(kind, key))
    return methods


def available_weightings() -> dict[str, Any]:
    """``gradbalance.WEIGHTINGS`` when the weighting package exists, else an empty dict."""
    try:
        from gradbalance.weighting import WEIGHTINGS
    except ImportError:
        return {}
    return dict(WEIGHTINGS)


def _norm(name: str) -> str:
    return name.strip().lower().replace("-", "").replace("_", "")


def _lookup(names: Iterable[str], registry: dict[str, Any], what: str, option: str,
            defaults: tuple[str, ...] | None) -> list[str]:
    table = {_norm(key): key for key in registry}
    found: list[str] = []
    missing: list[str] = []
    for name in names:
        key = table.get(_norm(name))
        if key is None:
            if defaults is not None:
                missing.append(name)
                continue
            valid = ", ".join(sorted(registry)) or "(none installed)"
            raise ValueError(f"Unknown {what} {name!r} in {option}; valid names: {valid}")
        needs = required_arguments(registry[key])
        if needs:
            raise ValueError(
                f"{what} {name!r} in {option} needs settings ({', '.join(needs)}) that this "
                f"command cannot choose; pick another of: {', '.join(runnable(registry))}"
            )
        if key not in found:
            found.append(key)
    if missing:
        warnings.warn(
            f"default {what}s not available in this installation, skipped: "
            f"{', '.join(missing)}", RuntimeWarning, stacklevel=3,
        )
    return found


def resolve_methods(balancers: list[str] | None, weightings: list[str] | None,
                    optional: bool = False, *, options: tuple[str, str] = ("--balancers",
                                                                          "--weightings"),
                    with_sum: bool = True) -> list[Method]:
    """Validate the requested names (``None``: the defaults that exist) into methods.

    With ``with_sum``, ``sum`` is included first (the buffer's step without balancing; the
    plain step, the time reference, is timed beside every method but not trained: it makes
    the same update). Methods from the defaults (or ``optional=True``, e.g. for ``all``) are marked
    optional. ``options`` name the command-line options in error messages.
    """
    chosen_b = _lookup(DEFAULT_BALANCERS if balancers is None else balancers, BALANCERS,
                       "balancer", options[0], DEFAULT_BALANCERS if balancers is None else None)
    registry_w = available_weightings()
    chosen_w = _lookup(DEFAULT_WEIGHTINGS if weightings is None else weightings, registry_w,
                       "weighting", options[1],
                       DEFAULT_WEIGHTINGS if weightings is None else None)
    if with_sum and "sum" in chosen_b:
        chosen_b.remove("sum")
    opt_b = optional or balancers is None
    opt_w = optional or weightings is None
    first = [Method("balancer", "sum")] if with_sum else []
    return (first + [Method("balancer", k, None, opt_b) for k in chosen_b]
            + [Method("weighting", k, None, opt_w) for k in chosen_w])


def required_arguments(cls: Any) -> list[str]:
    """Constructor arguments without a default, besides those ``compare`` supplies."""
    supplied = {"num_tasks", "generator", "layer", "task_types"}
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.name not in supplied
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def runnable(registry: dict[str, Any]) -> list[str]:
    """Names in ``registry`` that can be built with no user settings (for ``all``)."""
    return sorted(name for name, cls in registry.items() if not required_arguments(cls))


def _accepts(factory: Any, name: str) -> bool:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def build_balancer(key: str, num_tasks: int, seed: int) -> Balancer:
    """The registered balancer ``key`` for ``num_tasks`` tasks; seeded if it draws randoms."""
    cls = BALANCERS[key]
    kwargs: dict[str, Any] = {}
    if _accepts(cls, "num_tasks"):
        kwargs["num_tasks"] = num_tasks
    if _accepts(cls, "generator"):
        kwargs["generator"] = torch.Generator().manual_seed(10_000 + seed)
    return cls(**kwargs)


def build_weighting(key: str, data: Any, seed: int, trunk: Any) -> Any:
    """The registered loss weighting ``key`` for ``data``'s tasks.

    Passes what the constructor asks for: ``num_tasks``, a seeded ``generator``, GradNorm's
    shared ``layer`` (the trunk: its last layer is used) and Uncertainty Weighting's
    ``task_types`` (classification or regression per task).
    """
    return build_weighting_from(
        available_weightings()[key], data.num_tasks, seed, layer=trunk,
        task_types=["classification" if c else "regression" for c in data.is_classification])


def build_weighting_from(cls: Any, num_tasks: int, seed: int, *, layer: Any,
                         task_types: list[str] | None = None) -> Any:
    """``cls`` for ``num_tasks`` tasks with what its constructor asks for (a seeded
    ``generator``, GradNorm's ``layer``, ``task_types`` when known)."""
    params = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {"num_tasks": num_tasks}
    if "generator" in params:
        kwargs["generator"] = torch.Generator().manual_seed(10_000 + seed)
    if "layer" in params:
        kwargs["layer"] = layer
    if "task_types" in params and task_types is not None:
        kwargs["task_types"] = task_types
    return cls(**kwargs)
