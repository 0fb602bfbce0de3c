"""An independent reference for the dual-cone projections of UPGrad and DualProj: scipy's
NNLS over the unit rows, and the KKT conditions of each problem (docs/balancers.md,
"Solvers")."""

from __future__ import annotations

import torch
from torch import Tensor

from gradbalance.balancers import _boxqp
from support.many_kinds import assert_same_update


def scipy_projection(g: Tensor, u: Tensor) -> Tensor:
    """``Jᵀu`` projected onto ``{x : Jx ≥ 0}`` by scipy's NNLS over the unit rows (the same
    cone: ``x = Jᵀu + Σ yₖ ĝₖ``, ``y ≥ 0``; zero rows left out).

    Two scipy solvers, Lawson–Hanson's ``nnls`` and ``lsq_linear``'s BVLS, and the answer
    whose true residual ``‖Jᵀu + Σ yₖ ĝₖ‖`` is the smaller (judged by the residual, not by
    either solver's report: ``nnls`` of scipy 1.17 returns, for a point on the cone's
    boundary, a ``y`` whose residual exceeds that of ``y = 0`` while reporting a smaller
    one)."""
    from scipy.optimize import lsq_linear, nnls

    norms = g.norm(dim=1)
    unit = g[norms > 0] / norms[norms > 0, None]
    a = g.T @ u
    if unit.shape[0] == 0:
        return a
    y, _ = nnls(unit.T.numpy(), -a.numpy(), maxiter=10_000)
    bvls = lsq_linear(unit.T.numpy(), -a.numpy(), bounds=(0.0, float("inf")), method="bvls",
                      tol=1e-15)
    points = [a + unit.T @ torch.from_numpy(z).to(a.dtype) for z in (y, bvls.x)]
    return min(points, key=lambda x: float(x.norm()))


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


def assert_kkt(gram: Tensor, u: Tensor, v: Tensor) -> None:
    """``argmin_{v ≥ u} vᵀGv`` per row, from its optimality conditions: ``v ≥ u``; on the
    active set (``v = u``) ``w = Gv ≥ 0`` to ``1e-9`` of the sizes it is made of (``|G||v|``);
    on the free set ``w = 0`` to the tight solves' residual, at most ``CG_RTOL_MAX`` times
    ``‖(Gu)_F‖`` (the right-hand side there, :func:`~._boxqp.tight_residuals`), plus rounding."""
    y, w = v - u, v @ gram
    size = v.abs() @ gram.abs()
    top = v.abs().amax(dim=1, keepdim=True)
    assert bool((y >= -1e-12 * top).all())
    free = y > 1e-12 * top
    assert bool((w >= -1e-9 * size).logical_or(free).all())
    rhs = torch.linalg.vector_norm((u @ gram) * free, dim=1)
    residual = torch.linalg.vector_norm(w * free, dim=1)
    assert bool((residual <= 1.01 * _boxqp.CG_RTOL_MAX * rhs
                 + 1e-12 * torch.linalg.vector_norm(size, dim=1)).all())
