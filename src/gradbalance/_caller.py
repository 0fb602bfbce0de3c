"""The ``stacklevel`` of the first caller outside this package and torch, for a warning
raised deep inside a call that torch dispatches (``Module.load_state_dict`` recurses through
every submodule, so a fixed level points into torch or here)."""

from __future__ import annotations

import os
import sys

import torch

_INTERNAL = tuple(os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep
                  for m in (sys.modules[__package__ or "gradbalance"], torch))


def is_internal(path: str) -> bool:
    """Whether the source file ``path`` lies inside this package or torch."""
    return os.path.abspath(path).startswith(_INTERNAL)


def user_stacklevel() -> int:
    """``warnings.warn``'s ``stacklevel``, called from the function that warns, that names
    the first frame whose file lies outside this package and torch.

    Example:
        >>> import warnings
        >>> from gradbalance._caller import user_stacklevel
        >>> def deep():
        ...     warnings.warn("here", stacklevel=user_stacklevel())
    """
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and is_internal(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    return level
