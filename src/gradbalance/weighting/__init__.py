"""Loss weightings: K weighted task losses before the backward pass, one method per private
module, collected in :data:`WEIGHTINGS` (docs/weighting.md); kernels in
:mod:`gradbalance.functional`."""

from __future__ import annotations

from typing import Any

from .._registry import build, register
from ._base import LossWeighting
from ._dwa import DWA
from ._famo import FAMO
from ._gls import GLS
from ._gradnorm import GradNorm, last_layer_parameters
from ._imtl import IMTLL
from ._rlw import RLW
from ._scale_invariant import ScaleInvariant
from ._stch import STCH
from ._uncertainty import UncertaintyWeighting

__all__ = [
    "DWA", "FAMO", "GLS", "IMTLL", "RLW", "STCH", "WEIGHTINGS", "GradNorm", "LossWeighting",
    "ScaleInvariant", "UncertaintyWeighting", "get_weighting", "last_layer_parameters",
]

#: Registry name -> class, for every loss weighting the library ships.
WEIGHTINGS: dict[str, type[LossWeighting]] = {}

register(WEIGHTINGS, [
    DWA, FAMO, GLS, GradNorm, IMTLL, RLW, ScaleInvariant, STCH, UncertaintyWeighting,
], "loss weighting")


def get_weighting(name: str, **kwargs: Any) -> LossWeighting:
    """Build a loss weighting by registry name (case, - and _ ignored), e.g. ``"dwa"``.

    Example:
        >>> from gradbalance.weighting import get_weighting
        >>> get_weighting("dwa", num_tasks=2)
        DWA(num_tasks=2, temperature=2.0, period=1)
    """
    return build(WEIGHTINGS, name, "loss weighting", kwargs)
