"""The check of a ``balancer=`` argument, here so that :mod:`gradbalance._checks` never
imports a balancer (docs/ARCHITECTURE.md, "Layers")."""

from __future__ import annotations

from .._checks import short_repr
from ._base import Balancer

__all__ = ["check_balancer", "check_balancer_tasks"]


def check_balancer(name: str, value: object) -> None:
    """A :class:`~gradbalance.balancers.Balancer` instance (``TypeError`` otherwise)."""
    if isinstance(value, Balancer):
        return
    if isinstance(value, str):
        raise TypeError(
            f"Invalid {name}: {value!r}, a str (expected a Balancer object). Build it once, "
            f"before the loop, and pass the same object every step, so that a balancer with "
            f"state (GradVac's targets, Nash-MTL's warm start, a generator) keeps it: "
            f"{name} = gradbalance.get_balancer({value!r}, num_tasks=K)"
        )
    if isinstance(value, type) and issubclass(value, Balancer):
        raise TypeError(
            f"Invalid {name}: the class {value.__name__} (expected a Balancer object); build "
            f"it once before the loop: {name} = {value.__name__}()"
        )
    raise TypeError(
        f"Invalid {name}: {type(value).__name__} {short_repr(value)} (expected a Balancer "
        f"object, e.g. {name} = gradbalance.get_balancer('mgda', num_tasks=K), or an "
        f"instance of a Balancer subclass)"
    )


def check_balancer_tasks(balancer: Balancer, k: int) -> None:
    """``ValueError`` before anything moves when ``balancer`` is built for, or tracks in its
    state, another number of tasks than the step's ``k`` (the step is kept: pass the right
    balancer and call again)."""
    if balancer.num_tasks is not None and balancer.num_tasks != k:
        raise ValueError(
            f"balancer {type(balancer).__name__} was built with num_tasks="
            f"{balancer.num_tasks} but the step has {k} task losses; pass a balancer built "
            f"for {k} tasks (the step is kept: call apply_ again)"
        )
    balancer.check_tracked_tasks(k)
