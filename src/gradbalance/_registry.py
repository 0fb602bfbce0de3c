"""Registries filled by discovery: one method per private module of a sub-package.

``balancers/`` and ``weighting/`` share the rule: every private module ``_<method>.py`` (but
``_base``) is imported, its ``__all__`` re-exported by the package, and every subclass of the
package's base class with a non-empty ``name`` registered under that name. Names are looked up
ignoring case, ``-`` and ``_``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable, MutableMapping
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


def discover(package: str, path: Iterable[str], namespace: MutableMapping[str, Any],
             base: T, registry: MutableMapping[str, T], kind: str) -> None:
    """Import every private module of ``package`` and register its ``base`` subclasses.

    Each public name a module lists in ``__all__`` is put in ``namespace`` (the package's
    globals) and appended to ``namespace["__all__"]``. Two different classes registered under
    one name raise ``RuntimeError``.
    """
    exported: list[str] = namespace["__all__"]
    for info in sorted(pkgutil.iter_modules(path), key=lambda info: info.name):
        if not info.name.startswith("_") or info.name == "_base":
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name)
            namespace[name] = obj
            if name not in exported:
                exported.append(name)
            if isinstance(obj, type) and issubclass(obj, base) and getattr(obj, "name", ""):
                key = obj.name
                if key in registry and registry[key] is not obj:
                    raise RuntimeError(f"two {kind}s registered as {key!r}")
                registry[key] = obj


def _key(name: str) -> str:
    return name.lower().replace("-", "").replace("_", "")


def build(registry: MutableMapping[str, T], name: str, kind: str, kwargs: dict[str, Any]) -> Any:
    """``registry[name](**kwargs)``, the name matched ignoring case, ``-`` and ``_``."""
    lookup = {_key(k): v for k, v in registry.items()}
    if not isinstance(name, str) or _key(name) not in lookup:
        raise ValueError(f"Unknown {kind} {name!r}; valid names: {', '.join(sorted(registry))}")
    return lookup[_key(name)](**kwargs)
