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
