"""Loss weightings: one method per private module, collected in :data:`WEIGHTINGS`.

A loss weighting turns the K task losses into K weighted losses before the backward pass
(GradNorm, Uncertainty Weighting, DWA, RLW, GLS, SI, FAMO, IMTL-L, STCH). Every private module
``_<method>.py`` lists its public names in ``__all__``; they are re-exported here, and each
:class:`LossWeighting` subclass with a ``name`` is registered.
"""

from __future__ import annotations

from typing import Any

from .._registry import build, discover
from ._base import LossWeighting

__all__ = ["WEIGHTINGS", "LossWeighting", "get_weighting"]

#: Registry name -> class, for every loss weighting the library ships.
WEIGHTINGS: dict[str, type[LossWeighting]] = {}

discover(__name__, __path__, globals(), LossWeighting, WEIGHTINGS, "loss weighting")


def get_weighting(name: str, **kwargs: Any) -> LossWeighting:
    """Build a loss weighting by registry name (case, - and _ ignored), e.g. ``"dwa"``."""
    return build(WEIGHTINGS, name, "loss weighting", kwargs)
