"""An independent reference for the dual-cone projections of UPGrad and DualProj: scipy's
NNLS over the unit rows, and the KKT conditions of each problem (docs/balancers.md,
"Solvers")."""

from __future__ import annotations

import torch
from torch import Tensor

from support.many_kinds import assert_same_update


def scipy_projection(g: Tensor, u: Tensor) -> Tensor:
    """``Jᵀu`` projected onto ``{x : Jx ≥ 0}`` by scipy's NNLS over the unit rows (the same
    cone: ``x = Jᵀu + Σ yₖ ĝₖ``, ``y ≥ 0``; zero rows left out)."""
    from scipy.optimize import nnls

    norms = g.norm(dim=1)
    unit = g[norms > 0] / norms[norms > 0, None]
    a = g.T @ u
    if unit.shape[0] == 0:
        return a
    y, _ = nnls(unit.T.numpy(), -a.numpy(), maxiter=10_000)
    return a + unit.T @ torch.from_numpy(y)


def assert_projections(g: Tensor, u: Tensor, v: Tensor) -> None:
    """Every problem ``i``: the update ``Jᵀvᵢ`` scipy's projection (cosine ≥ 0.999999, norm
    within 1e-6), ``vᵢ ≥ uᵢ``, in the dual cone and complementary to ``vᵢ − uᵢ``, relative
    to the rows' norms."""
    norms = g.norm(dim=1)
    for i in range(u.shape[0]):
        x = v[i] @ g
        assert_same_update(x, scipy_projection(g, u[i]), g)
        size = float((u[i] * norms).sum())
        assert bool((v[i] >= u[i] * (1 - 1e-12)).all())
        if size == 0.0:  # only zero rows bounded: x = 0, checked above
            continue
        slack = g @ x / (norms * size).clamp_min(1e-300)
        assert float(slack.min()) >= -1e-9
        assert float(((v[i] - u[i]) * norms / size * slack.abs()).max()) <= 1e-9
