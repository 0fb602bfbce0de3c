"""The cosine matrix of a Gramian whose norms lie decades apart, where it is well conditioned.

Not a balancer module (no ``__all__``). ``G = DCD`` (``D = diag(‖gₖ‖)``): the eigenvalues of
``G`` spread as the squared norms (rows of norms ``1e-6 … 1e6``: ``1e24``), those of ``C``
only as the directions'. Where the norms lie decades apart, a solver that reads ``G`` with
tolerances relative to its largest entries loses the short rows; CAGrad's dual
(:mod:`~._cagrad_scaled`) and IMTL-G's ``G⁻¹d`` (:mod:`~._imtlg`) run on ``C`` instead.

Example:
    >>> import torch
    >>> gram = torch.diag(torch.tensor([1e-12, 1.0, 1e12], dtype=torch.float64))
    >>> scaled = scaled_cosine(gram)
    >>> scaled.cosine.diagonal().tolist(), scaled.norms.tolist()
    ([1.0, 1.0, 1.0], [1e-06, 1.0, 1000000.0])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from ._boxqp import is_well_conditioned
from ._cholesky import Factor, cholesky_ex
from ._precond import symmetrized

#: The cosine matrix is taken where the largest diagonal entry of ``G`` is more than this
#: times the smallest (norms more than about 30× apart), as MGDA's cosine route.
SCALED_MIN_RATIO = 1e3


class ScaledCosine(NamedTuple):
    """:func:`scaled_cosine`'s answer: the rows' norms ``d``, ``C = D⁻¹GD⁻¹`` and its Cholesky
    factor."""

    norms: Tensor
    cosine: Tensor
    factor: Factor


def spread_cosine(gram: Tensor) -> tuple[Tensor, Tensor] | None:
    """``(d, C)``: the rows' norms and the cosine matrix (symmetrised) where ``gram``'s
    diagonal spans more than ``SCALED_MIN_RATIO`` and no row is zero, else None. One host
    sync for the diagonal (``K`` floats: cheaper than two reductions below 64 tasks)."""
    diag = torch.diagonal(gram)
    values = diag.tolist()
    low, high = min(values, default=0.0), max(values, default=0.0)
    if not (low > 0.0 and high > SCALED_MIN_RATIO * low):
        return None
    d = diag.sqrt()
    return d, symmetrized(gram / torch.outer(d, d))


def well_conditioned_factor(cos: Tensor) -> Factor | None:
    """``C``'s Cholesky factor where ``C`` is positive definite with condition number below
    ``1e10`` (:func:`~._boxqp.is_well_conditioned`, from the factor), else None."""
    factor = cholesky_ex(cos)
    if int(factor.info) != 0 or not is_well_conditioned(cos, factor):
        return None
    return factor


def scaled_cosine(gram: Tensor) -> ScaledCosine | None:
    """:class:`ScaledCosine` of ``gram`` where :func:`spread_cosine` gives ``C`` and
    :func:`well_conditioned_factor` its factor, else None."""
    spread = spread_cosine(gram)
    if spread is None:
        return None
    d, cos = spread
    factor = well_conditioned_factor(cos)
    return None if factor is None else ScaledCosine(d, cos, factor)
