"""``gradbalance compare --model pkg.module:factory``: the user's model and data, loaded.

``factory()`` returns a mapping of :func:`gradbalance_lab.compare.compare`'s arguments: at
least ``build_model`` and ``make_batches``, and any of ``shared``, ``evaluate``,
``higher_is_better``, ``task_names``, ``optimizer``. The module is imported with the current
folder first on the import path, as ``python -m`` would.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["FACTORY_KEYS", "load_factory"]

#: The arguments of ``compare`` a factory may return.
FACTORY_KEYS = ("build_model", "make_batches", "shared", "evaluate", "higher_is_better",
                "task_names", "optimizer")

_FIX = "give --model pkg.module:factory, factory() returning dict(build_model=..., " \
       "make_batches=...)"


def _import(module: str, spec: str) -> Any:
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ValueError(f"--model {spec}: cannot import {module!r} ({error}); run from the "
                         "folder that holds it or install it") from None
    finally:
        if added:
            sys.path.remove(cwd)


def load_factory(spec: str) -> dict[str, Any]:
    """``compare``'s arguments from ``factory()`` of ``spec`` (``pkg.module:factory``); a
    ValueError naming ``--model`` for anything that does not fit."""
    module, _, name = spec.partition(":")
    if not module or not name or not all(part.isidentifier() for part in
                                         [*module.split("."), *name.split(".")]):
        raise ValueError(f"--model {spec!r}: expected pkg.module:factory; {_FIX}")
    target: Any = _import(module, spec)
    for part in name.split("."):
        if not hasattr(target, part):
            raise ValueError(f"--model {spec}: module {module!r} has no {name!r}; {_FIX}")
        target = getattr(target, part)
    if not callable(target):
        raise ValueError(f"--model {spec}: {name} is a {type(target).__name__}, not a "
                         f"callable; {_FIX}")
    try:
        made = target()
    except Exception as error:  # the user's code: one line naming --model, not a traceback
        raise ValueError(f"--model {spec}: {name}() raised {type(error).__name__}: {error}"
                         ) from None
    if not isinstance(made, Mapping):
        raise ValueError(f"--model {spec}: {name}() returned a {type(made).__name__}; {_FIX}")
    unknown = sorted(set(made) - set(FACTORY_KEYS))
    missing = [key for key in ("build_model", "make_batches") if key not in made]
    if unknown or missing:
        raise ValueError(f"--model {spec}: {name}() returned keys {sorted(made)}; missing "
                         f"{missing}, unknown {unknown} (allowed: {', '.join(FACTORY_KEYS)})")
    return dict(made)
