"""Loss weightings: one method per private module, collected in :data:`WEIGHTINGS`.

A loss weighting turns the K task losses into K weighted losses before the backward pass
(GradNorm, Uncertainty Weighting, DWA, RLW, GLS, FAMO, IMTL-L, STCH). Every private module
``_<method>.py`` lists its public names in ``__all__``; they are re-exported here, and each
:class:`LossWeighting` subclass with a ``name`` is registered.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from ._base import LossWeighting

__all__ = ["WEIGHTINGS", "LossWeighting", "get_weighting"]

#: Registry name -> class, for every loss weighting the library ships.
WEIGHTINGS: dict[str, type[LossWeighting]] = {}

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
    if not _info.name.startswith("_") or _info.name == "_base":
        continue
    _module = importlib.import_module(f"{__name__}.{_info.name}")
    for _name in getattr(_module, "__all__", ()):
        _obj = getattr(_module, _name)
        globals()[_name] = _obj
        if _name not in __all__:
            __all__.append(_name)
        if isinstance(_obj, type) and issubclass(_obj, LossWeighting) and _obj.name:
            if _obj.name in WEIGHTINGS and WEIGHTINGS[_obj.name] is not _obj:
                raise RuntimeError(f"two loss weightings registered as {_obj.name!r}")
            WEIGHTINGS[_obj.name] = _obj


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def get_weighting(name: str, **kwargs: Any) -> LossWeighting:
    """Build a loss weighting by registry name (case, - and _ ignored), e.g. ``"dwa"``."""
    lookup = {_key(k): v for k, v in WEIGHTINGS.items()}
    if not isinstance(name, str) or _key(name) not in lookup:
        raise ValueError(
            f"Unknown loss weighting {name!r}; valid names: {', '.join(sorted(WEIGHTINGS))}"
        )
    return lookup[_key(name)](**kwargs)
