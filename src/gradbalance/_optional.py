"""Optional dependencies: import on first use, or a clear error naming the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["pyplot", "require"]


def require(module: str, extra: str, needed_by: str, alternative: str | None = None
            ) -> ModuleType:
    """Import ``module`` or raise an ``ImportError`` naming ``pip install gradbalance[extra]``,
    what wanted it (``needed_by``) and how to do without it (``alternative``)."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        package = module.split(".")[0]
        hint = f" (or {alternative})" if alternative else ""
        raise ImportError(
            f"{needed_by} needs {package}, which is not installed: "
            f"pip install gradbalance[{extra}]{hint}"
        ) from error


def pyplot(needed_by: str = "plotting", alternative: str | None = "pass --no-plot"
           ) -> ModuleType:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (extra ``plot``)."""
    matplotlib = require("matplotlib", "plot", needed_by, alternative)
    matplotlib.use("Agg", force=True)
    return importlib.import_module("matplotlib.pyplot")
