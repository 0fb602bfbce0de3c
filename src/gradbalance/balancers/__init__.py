"""Gradient balancers: one algorithm per private module, collected in :data:`BALANCERS`
(docs/balancers.md); their pure kernels are in :mod:`gradbalance.functional`."""

from __future__ import annotations

from typing import Any

from .._registry import build, register
from .._shard import Shard, dim0_runs
from ._alignedmtl import AlignedMTL
from ._base import Balancer, Combination
from ._cagrad import CAGrad
from ._config import ConFIG
from ._constant import Constant
from ._crmogm import CRMOGM
from ._dbmtl import DBMTL
from ._dualproj import DualProj
from ._excessmtl import ExcessMTL
from ._fairgrad import FairGrad
from ._graddrop import GradDrop
from ._gradvac import GradVac
from ._imtlg import IMTLG
from ._krum import Krum
from ._mean import Mean
from ._mgda import MGDA
from ._moco import MoCo
from ._modo import MoDo
from ._nashmtl import NashMTL
from ._pcd import PCD
from ._pcgrad import PCGrad
from ._random import Random
from ._sdmgrad import SDMGrad
from ._solvers import SolverError
from ._sum import Sum
from ._trimmed_mean import TrimmedMean
from ._upgrad import UPGrad

__all__ = [
    "BALANCERS", "CRMOGM", "DBMTL", "IMTLG", "MGDA", "PCD", "AlignedMTL", "Balancer", "CAGrad",
    "Combination", "ConFIG", "Constant", "DualProj", "ExcessMTL", "FairGrad", "GradDrop",
    "GradVac", "Krum", "Mean", "MoCo", "MoDo", "NashMTL", "PCGrad", "Random", "SDMGrad",
    "Shard", "SolverError", "Sum", "TrimmedMean", "UPGrad", "dim0_runs", "get_balancer",
]

#: Registry name -> class, for every balancer the library ships.
BALANCERS: dict[str, type[Balancer]] = {}

register(BALANCERS, [
    AlignedMTL, CAGrad, ConFIG, Constant, CRMOGM, DBMTL, DualProj, ExcessMTL, FairGrad,
    GradDrop, GradVac, IMTLG, Krum, Mean, MGDA, MoCo, MoDo, NashMTL, PCD, PCGrad, Random,
    SDMGrad, Sum, TrimmedMean, UPGrad,
], "balancer")


def balancer_names() -> tuple[str, ...]:
    """The class names of the registered balancers (yours too, once registered)."""
    return tuple(cls.__name__ for cls in BALANCERS.values())


def get_balancer(name: str, **kwargs: Any) -> Balancer:
    """Build a balancer by registry name (case, - and _ ignored), e.g. ``"pcgrad"``.

    Example:
        >>> from gradbalance.balancers import get_balancer
        >>> get_balancer("pcgrad")
        PCGrad(num_tasks=None, reduction='sum')
    """
    return build(BALANCERS, name, "balancer", kwargs)
