"""The KKT test of a batch of box problems on the whole ``Q``, for the routes that solve a
reduced problem instead (``_parallel_groups``, ``_combinations``).

Not a balancer module (no ``__all__``). ``v = argmin ½ vᵀQv`` s.t. ``v ≥ lower`` holds where
the multipliers ``w = vQ`` are at least ``−b`` at the bound and within ``b`` of zero above it,
``v ≥ lower`` and finite. The scale is ``dⱼ Σₖ dₖ|vₖ|`` (``d = diag(Q)^{1/2}``; by
Cauchy–Schwarz at least ``(|v||Q|)ⱼ``, the sizes ``wⱼ`` is made of, without a second
product): ``b = rtol dⱼ Σₖ dₖ|vₖ|`` plus the caller's ``slack``.

Example:
    >>> import torch
    >>> q = torch.tensor([[2.0, -1.0], [-1.0, 2.0]], dtype=torch.float64)
    >>> lower = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
    >>> box_kkt_holds(q, lower, torch.tensor([[1.0, 0.5]], dtype=torch.float64), 1e-12).tolist()
    [True]
"""

from __future__ import annotations

import torch
from torch import Tensor


def box_kkt_holds(q: Tensor, lower: Tensor, v: Tensor, rtol: float,
                  slack: Tensor | None = None, vq: Tensor | None = None) -> Tensor:
    """``[B]``: the problems whose ``v`` ``[B, n]`` meets the KKT conditions of ``min ½
    vᵀQv`` s.t. ``v ≥ lower`` to ``rtol dⱼ Σₖ dₖ|vₖ|`` plus ``slack`` (``[B, n]``, where
    given) on each multiplier (module docstring); ``vq``: the product ``vQ`` where the caller
    has it."""
    d = torch.diagonal(q).clamp_min(0.0).sqrt()
    w = v @ q if vq is None else vq
    bound = rtol * d[None, :] * (v.abs() @ d)[:, None]
    if slack is not None:
        bound = bound + slack
    above = v > lower
    ok = (w >= -bound) & (~above | (w <= bound)) & (v >= lower)
    return ok.all(dim=1) & torch.isfinite(v).all(dim=1)
