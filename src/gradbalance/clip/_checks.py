"""The check of a step's ``clip=`` argument, kept with the clippers so that
:mod:`gradbalance._checks` below them never imports a clipper (docs/ARCHITECTURE.md, "Layers")."""

from __future__ import annotations

from .._checks import short_repr
from ._agc import AGC
from ._auto import AutoClip

__all__ = ["check_row_clipper"]


def check_row_clipper(name: str, value: object) -> None:
    """None or a row clipper: a callable taking ``G`` ``[K, P]`` (``TypeError`` otherwise)."""
    if value is None:
        return
    if isinstance(value, (AutoClip, AGC)):
        row = "TaskAutoClip()" if isinstance(value, AutoClip) else "TaskClip(max_norm=...)"
        raise TypeError(
            f"Invalid {name}: {type(value).__name__}, a clipper of the parameters' .grad (call "
            f"it on model.parameters() after apply_(), before optimizer.step()); {name}= takes "
            f"a row clipper of G [K, P], e.g. {name}=gradbalance.{row}"
        )
    if not callable(value):
        raise TypeError(
            f"Invalid {name}: {type(value).__name__} {short_repr(value)} (expected None or a "
            f"row clipper, a callable taking G [K, P], e.g. {name}=gradbalance.TaskClip(1.0))"
        )
