"""Gradient balancers: one algorithm per private module, collected in :data:`BALANCERS`.

Every private module ``_<method>.py`` lists its public names in ``__all__``; they are
re-exported here, and each :class:`Balancer` subclass with a ``name`` is registered.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from ._base import Balancer, Combination, combine_rows

__all__ = ["BALANCERS", "Balancer", "Combination", "combine_rows", "get_balancer"]

#: Registry name -> class, for every balancer the library ships.
BALANCERS: dict[str, type[Balancer]] = {}

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
    if not _info.name.startswith("_") or _info.name == "_base":
        continue
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _name in getattr(_module, "__all__", ()):
        _obj = getattr(_module, _name)
        globals()[_name] = _obj
        if _name not in __all__:
            __all__.append(_name)
        if isinstance(_obj, type) and issubclass(_obj, Balancer) and _obj.name:
            if _obj.name in BALANCERS and BALANCERS[_obj.name] is not _obj:
                raise RuntimeError(f"two balancers registered as {_obj.name!r}")
            BALANCERS[_obj.name] = _obj


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def get_balancer(name: str, **kwargs: Any) -> Balancer:
    """Build a balancer by registry name (case, - and _ ignored), e.g. ``"pcgrad"``."""
    lookup = {_key(k): v for k, v in BALANCERS.items()}
    if _key(name) not in lookup:
        raise ValueError(
            f"Unknown balancer {name!r}; valid names: {', '.join(sorted(BALANCERS))}"
        )
    return lookup[_key(name)](**kwargs)
