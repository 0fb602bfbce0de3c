"""Gradient balancers: one algorithm per private module, collected in :data:`BALANCERS`."""

from __future__ import annotations

from typing import Any

from ._base import Balancer, Combination, combine_rows
from ._constant import Constant
from ._mean import Mean, mean_weights
from ._sum import Sum, sum_weights

__all__ = [
    "BALANCERS",
    "Balancer",
    "Combination",
    "Constant",
    "Mean",
    "Sum",
    "combine_rows",
    "get_balancer",
    "mean_weights",
    "sum_weights",
]

#: Registry name -> class, for every balancer the library ships.
BALANCERS: dict[str, type[Balancer]] = {cls.name: cls for cls in (Sum, Mean, Constant)}


def get_balancer(name: str, **kwargs: Any) -> Balancer:
    """Build a balancer by registry name (case-insensitive), e.g. ``get_balancer("pcgrad")``."""
    key = name.lower().replace("-", "").replace("_", "")
    lookup = {k.replace("-", "").replace("_", ""): v for k, v in BALANCERS.items()}
    if key not in lookup:
        raise ValueError(
            f"Unknown balancer {name!r}; valid names: {', '.join(sorted(BALANCERS))}"
        )
    return lookup[key](**kwargs)
