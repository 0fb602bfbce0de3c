"""Gradient balancers: one algorithm per private module, collected in :data:`BALANCERS`.

Every private module ``_<method>.py`` lists its public names in ``__all__``; they are
re-exported here, and each :class:`Balancer` subclass with a ``name`` is registered.
"""

from __future__ import annotations

from typing import Any

from .._registry import build, discover
from ._base import Balancer, Combination, combine_rows

__all__ = ["BALANCERS", "Balancer", "Combination", "combine_rows", "get_balancer"]

#: Registry name -> class, for every balancer the library ships.
BALANCERS: dict[str, type[Balancer]] = {}

discover(__name__, __path__, globals(), Balancer, BALANCERS, "balancer")


def get_balancer(name: str, **kwargs: Any) -> Balancer:
    """Build a balancer by registry name (case, - and _ ignored), e.g. ``"pcgrad"``."""
    return build(BALANCERS, name, "balancer", kwargs)
