"""Registries of the methods the library ships: name -> class, names matched ignoring case,
``-`` and ``_`` (``"Nash-MTL"``, ``"nash_mtl"`` and ``"nashmtl"`` agree)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T")


def register(registry: MutableMapping[str, type[T]], classes: Iterable[type[T]],
             kind: str) -> None:
    """Put every class with a ``name`` in ``registry`` (two under one name raise RuntimeError)."""
    for cls in classes:
        key: str = getattr(cls, "name", "")
        if not key:
            continue
        if key in registry and registry[key] is not cls:
            raise RuntimeError(f"two {kind}s registered as {key!r}")
        registry[key] = cls


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def build(registry: MutableMapping[str, type[T]], name: str, kind: str,
          kwargs: dict[str, Any]) -> T:
    """``registry[name](**kwargs)``, the name matched ignoring case, ``-`` and ``_``."""
    lookup = {_key(k): v for k, v in registry.items()}
    if not isinstance(name, str) or _key(name) not in lookup:
        raise ValueError(
            f"Unknown {kind} {name!r}; valid names: {', '.join(sorted(registry))}"
        )
    cls = lookup[_key(name)]
    missing = _missing_arguments(cls, kwargs)
    if missing:
        given = ", ".join([repr(name), *(f"{k}=..." for k in kwargs)])
        raise TypeError(
            f"{kind} {name!r} ({cls.__name__}) needs {', '.join(missing)}: pass "
            f"{', '.join(f'{m}=...' for m in missing)} too, e.g. get_{kind.split()[-1]}({given}, "
            f"{', '.join(f'{m}=...' for m in missing)}); see {cls.__name__}'s docstring"
        )
    return cls(**kwargs)


def _missing_arguments(cls: type[Any], kwargs: dict[str, Any]) -> list[str]:
    """The required keyword-able arguments of ``cls`` that ``kwargs`` leaves out."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in params if p.default is p.empty and p.name not in kwargs
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
