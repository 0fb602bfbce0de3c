"""Load a test module that sits beside the caller (the tests folders are not packages), to
reuse its model, data and reference loop."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def load_sibling(caller: str, name: str) -> ModuleType:
    """The module ``name`` (e.g. ``"test_accelerate"``) of the folder of file ``caller``."""
    path = Path(caller).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_sibling_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"Invalid sibling: {path} cannot be loaded")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
