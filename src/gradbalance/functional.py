"""The pure kernels behind the classes: tensors in, tensors out, no state, no ``.grad``.

Naming: ``<method>_weights`` gives the weights ``w`` ``[K]`` (``g = wᵀ G``; ``(w, state)``
for a method with state), ``<method>_coefficients`` a ``[K, K]`` matrix ``C`` of per-task
projections (``g_i = Σⱼ C[i, j] gⱼ``), ``<method>_update`` a combined gradient ``[P]``,
``<method>_step`` one step of a method's state, ``<method>_orders`` random visiting orders;
in-place clipping kernels end in ``_`` and return the pre-clip norms.

Example:
    >>> import torch
    >>> from gradbalance.functional import compute_gramian, mgda_weights
    >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    >>> mgda_weights(compute_gramian(g))
    tensor([0.8000, 0.2000], dtype=torch.float64)
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ._checks import check_square
from .balancers._alignedmtl import alignedmtl_weights
from .balancers._base import combine_rows
from .balancers._cagrad import cagrad_weights
from .balancers._config import config_weights
from .balancers._dbmtl import dbmtl_update
from .balancers._dualproj import dualproj_weights
from .balancers._excessmtl import excessmtl_risks
from .balancers._fairgrad import fairgrad_weights
from .balancers._graddrop import graddrop_update
from .balancers._gradvac import gradvac_coefficients, gradvac_orders
from .balancers._imtlg import imtlg_weights
from .balancers._krum import krum_weights
from .balancers._mean import mean_weights
from .balancers._mgda import mgda_weights
from .balancers._moco import moco_step
from .balancers._modo import modo_step
from .balancers._nashmtl import nashmtl_weights
from .balancers._pcd import pcd_weights
from .balancers._pcgrad import pcgrad_coefficients, pcgrad_orders
from .balancers._random import random_weights
from .balancers._sdmgrad import sdmgrad_weights
from .balancers._sum import sum_weights
from .balancers._trimmed_mean import trimmed_mean_update
from .balancers._upgrad import upgrad_weights
from .clip._agc import adaptive_clip_grad_, unitwise_norm
from .clip._per_sample_func import per_sample_grad_norms_of_model
from .clip._per_sample_graph import per_sample_grad_norms
from .clip._task import clip_task_norms_, clip_task_values_, row_norms
from .gramian import (
    compute_gramian,
    cosine_matrix,
    is_finite_gramian,
    linear_gramian,
    products_rounding,
)
from .taskgrads import task_gradients
from .weighting._dwa import dwa_weights
from .weighting._famo import famo_weights
from .weighting._gls import gls_weights
from .weighting._gradnorm import gradnorm_targets
from .weighting._scale_invariant import scale_invariant_weights
from .weighting._stch import stch_weights

_Kernel = TypeVar("_Kernel", bound=Callable[..., Any])


def _on_checked_gramian(kernel: _Kernel) -> _Kernel:
    """``kernel`` with its ``gramian`` argument checked first: a tensor, square, finite, a
    non-negative diagonal (one host sync) and read as its values (detached): a NaN on the
    diagonal gave near-uniform weights, ``−G`` uniform or zero ones, a Gramian that required
    grad weights carrying a graph or torch's error."""
    where = list(inspect.signature(kernel).parameters).index("gramian")

    @functools.wraps(kernel)
    def checked(*args: Any, **kwargs: Any) -> Any:
        args_list = list(args)
        given = args_list[where] if len(args_list) > where else kwargs.get("gramian")
        gramian = check_square("gramian", given).detach()
        finite, signed = torch.stack([torch.isfinite(gramian).all(),
                                      (torch.diagonal(gramian) >= 0).all()]).tolist()
        if not finite:
            raise ValueError("gramian holds inf or NaN; compute it from finite task gradients "
                             "(gradbalance.functional.is_finite_gramian tells)")
        if not signed:
            raise ValueError(f"gramian has negative diagonal entries "
                             f"({torch.diagonal(gramian).min().item():.3g}), which are squared "
                             f"norms: pass G Gᵀ (compute_gramian of the task gradients)")
        if len(args_list) > where:
            args_list[where] = gramian
        else:
            kwargs["gramian"] = gramian
        return kernel(*args_list, **kwargs)
    return checked  # type: ignore[return-value]


alignedmtl_weights = _on_checked_gramian(alignedmtl_weights)
cagrad_weights = _on_checked_gramian(cagrad_weights)
config_weights = _on_checked_gramian(config_weights)
dualproj_weights = _on_checked_gramian(dualproj_weights)
fairgrad_weights = _on_checked_gramian(fairgrad_weights)
gradvac_coefficients = _on_checked_gramian(gradvac_coefficients)
imtlg_weights = _on_checked_gramian(imtlg_weights)
krum_weights = _on_checked_gramian(krum_weights)
mgda_weights = _on_checked_gramian(mgda_weights)
modo_step = _on_checked_gramian(modo_step)
nashmtl_weights = _on_checked_gramian(nashmtl_weights)
pcd_weights = _on_checked_gramian(pcd_weights)
pcgrad_coefficients = _on_checked_gramian(pcgrad_coefficients)
sdmgrad_weights = _on_checked_gramian(sdmgrad_weights)
upgrad_weights = _on_checked_gramian(upgrad_weights)

__all__ = [
    "adaptive_clip_grad_", "alignedmtl_weights", "cagrad_weights", "clip_task_norms_",
    "clip_task_values_", "combine_rows", "compute_gramian", "config_weights", "cosine_matrix",
    "dbmtl_update", "dualproj_weights", "dwa_weights", "excessmtl_risks", "fairgrad_weights",
    "famo_weights", "gls_weights", "graddrop_update", "gradnorm_targets", "gradvac_coefficients",
    "gradvac_orders", "imtlg_weights", "is_finite_gramian", "krum_weights", "linear_gramian",
    "mean_weights", "mgda_weights", "moco_step", "modo_step", "nashmtl_weights", "pcd_weights",
    "pcgrad_coefficients", "pcgrad_orders", "per_sample_grad_norms",
    "per_sample_grad_norms_of_model", "products_rounding", "random_weights", "row_norms",
    "scale_invariant_weights", "sdmgrad_weights", "stch_weights", "sum_weights",
    "task_gradients", "trimmed_mean_update", "unitwise_norm", "upgrad_weights",
]
