"""The optional packages a command needs, checked together before any work.

A core-only install (``pip install gradbalance``) has none of them; a command that needs
several names them all in one message, with the one ``pip install`` line that adds them
(and ``gradbalance[all]``, which holds every one).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Extra", "missing_extras", "missing_message"]


@dataclass(frozen=True)
class Extra:
    """An optional package: the module imported, the extra that installs it, what wants it
    and how to do without it (``None``: it cannot be skipped)."""

    module: str
    extra: str
    needed_by: str
    skip: str | None = None
    package: str = ""  # the name pip installs, when it is not the module's

    @property
    def shown(self) -> str:
        return self.package or self.module.split(".")[0]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent missing, or a module set to None
        return False


def missing_extras(extras: Sequence[Extra]) -> list[Extra]:
    """The entries of ``extras`` whose module is not installed, in order."""
    return [extra for extra in extras if not _installed(extra.module)]


def missing_message(missing: Sequence[Extra]) -> str:
    """One message naming every missing package, what needs it, and one install line."""
    parts = []
    for extra in missing:
        skip = f", or {extra.skip}" if extra.skip else ""
        parts.append(f"{extra.needed_by} needs {extra.shown} "
                     f"(pip install gradbalance[{extra.extra}]{skip})")
    names = ",".join(dict.fromkeys(extra.extra for extra in missing))
    return (f"{'; '.join(parts)}; install {'it' if len(missing) == 1 else 'them all'} with "
            f"pip install \"gradbalance[{names}]\" (or \"gradbalance[all]\")")
