"""UPGrad and DualProj on two tasks opposite within float64's rounding.

``g`` and ``−2.5g`` plus ``1e-8`` of ``g``'s size in noise have ``1 − |cos| ≈ 1e-17``, below
what the Gramian resolves: the answer is the projection onto the dual cone with the two rows
exactly opposite (the cone's face ``gᵀx = 0``), with weights of the problem's own size
(``balancers/_boxqp.py``, :func:`resolved_box`). Before, the solvers took the two rows as
independent and put weights of ``1e6 … 1e10`` on their sum: updates 20 % to 8 times the
projection's size off it at K = 5 … 40. The references are independent of the library: every
face of the cone enumerated in numpy (K ≤ 8), or Clarabel on the primal projection with the
face ``gᵀx = 0`` eliminated (K = 16, 40).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import Tensor

from gradbalance.balancers import DualProj, UPGrad
from gradbalance.balancers._boxqp import weight_ratios

cp = pytest.importorskip("cvxpy")

F64 = torch.float64


def rows(seed: int, k: int, spread: bool, p: int = 200) -> tuple[Tensor, Tensor]:
    """``(near, exact)`` ``[K, P]`` float64: ``K − 2`` conflicting rows (norms ``1e-3 … 1e3``
    with ``spread``), ``g`` and ``−2.5g`` plus noise of ``1e-8‖g‖`` (``near``) or without
    (``exact``)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(p, generator=gen, dtype=F64)
    shared = torch.randn(p, generator=gen, dtype=F64)
    scale = torch.randn(k - 2, 1, generator=gen, dtype=F64)
    others = scale * shared + 0.5 * torch.randn(k - 2, p, generator=gen, dtype=F64)
    if spread:
        others = others * torch.logspace(-3, 3, k - 2, dtype=F64)[:, None]
    noise = torch.randn(p, generator=gen, dtype=F64)
    near = -2.5 * g + 1e-8 * g.norm() * noise / noise.norm()
    return torch.cat([others, g[None], near[None]]), torch.cat([others, g[None], -2.5 * g[None]])


def faces_projection(a: np.ndarray, g: np.ndarray) -> np.ndarray:
    """The projection of ``g`` onto ``{x : a x ≥ 0}`` (unit rows ``a``): the closest of the
    projections onto the null spaces of every subset of rows that is feasible."""
    best, out = np.inf, g
    for r in range(len(a) + 1):
        for face in itertools.combinations(range(len(a)), r):
            x = g
            if face:
                sub = a[list(face)]
                x = g - sub.T @ np.linalg.lstsq(sub.T, g, rcond=None)[0]
            feasible = (a @ x).min() >= -1e-12 * max(1.0, float(np.linalg.norm(x)))
            if feasible and np.linalg.norm(x - g) < best:
                best, out = float(np.linalg.norm(x - g)), x
    return out


def clarabel_projection(a: np.ndarray, g: np.ndarray, face: np.ndarray) -> np.ndarray:
    """The projection of ``g`` onto ``{x : a x ≥ 0, faceᵀx = 0}`` (unit ``face``), in the
    coordinates orthogonal to ``face`` (the other rows projected there are in general
    position), by Clarabel, then exactly on the active set it finds."""
    off = np.eye(len(face)) - np.outer(face, face)
    size = float(np.linalg.norm(g))
    x = cp.Variable(len(face))
    problem = cp.Problem(cp.Minimize(cp.sum_squares(x - off @ g / size)), [(a @ off) @ x >= 0])
    for tol in (1e-11, 1e-10, 1e-9):  # the tightest Clarabel reaches on the problem
        try:
            problem.solve(solver=cp.CLARABEL, tol_gap_abs=tol, tol_gap_rel=tol, tol_feas=tol)
        except cp.error.SolverError:
            continue
        if problem.status == "optimal":
            break
    # Clarabel's gap tolerance leaves x about its square root off: the projection onto the
    # null space of the active rows it finds, exactly, the active set corrected until the
    # point is feasible with non-negative multipliers (x = t + Aᵀμ, μ ≥ 0)
    rows_off = a @ off
    target = off @ g / size
    active = set(np.nonzero(rows_off @ x.value <= 1e-6)[0].tolist())
    for _ in range(len(a) + 1):
        sub = rows_off[sorted(active)]
        mult = -np.linalg.lstsq(sub.T, target, rcond=None)[0] if active else np.zeros(0)
        polished = target + sub.T @ mult if active else target
        if active and mult.min() < -1e-12:
            active.discard(sorted(active)[int(mult.argmin())])
            continue
        slack = rows_off @ polished
        if slack.min() < -1e-12:
            active.add(int(slack.argmin()))
            continue
        return off @ polished * size
    raise AssertionError("the active-set polish did not settle")


def reference(exact: Tensor, targets: Tensor) -> Tensor:
    """The mean of the projections of ``targets`` ``[B, P]`` onto the dual cone of the
    ``exact`` rows (the last two opposite)."""
    j = exact.numpy()
    norms = np.linalg.norm(j, axis=1)
    a = j / norms[:, None]
    t = targets.numpy()
    if len(a) <= 8:
        return torch.tensor(np.mean([faces_projection(a, v) for v in t], axis=0))
    rest = a[:-2]
    return torch.tensor(np.mean([clarabel_projection(rest, v, a[-2]) for v in t], axis=0))


def upgrad_targets(near: Tensor) -> Tensor:
    """UPGrad projects each row (its mean over them, uniform preference)."""
    return near


def dualproj_targets(near: Tensor) -> Tensor:
    """DualProj projects the rows' mean."""
    return near.mean(dim=0, keepdim=True)


CASES = [(k, seed, spread, 200) for k in (5, 8) for seed in range(4) for spread in (False, True)]
CASES += [(16, 0, True, 200), (16, 1, False, 200), (40, 0, True, 200), (40, 2, False, 300)]


@pytest.mark.parametrize(("k", "seed", "spread", "p"), CASES)
@pytest.mark.parametrize(("balancer", "targets"), [(UPGrad, upgrad_targets),
                                                   (DualProj, dualproj_targets)])
def test_opposite_rows_give_the_projection_on_their_face(k: int, seed: int, spread: bool,
                                                         p: int, balancer: type,
                                                         targets: Callable[[Tensor], Tensor]
                                                         ) -> None:
    near, exact = rows(seed, k, spread, p)
    expected = reference(exact, targets(near))
    for dtype, rtol in ((F64, 1e-6), (torch.float32, 1e-5)):
        result = balancer().combine(near.to(dtype))
        assert result.weights is not None
        err = float((result.vector.to(F64) - expected).norm() / expected.norm())
        assert err <= rtol, (dtype, err)
        # the problem's own size: 9.5e4 at most on these rows (norms 1e-3 … 1e3), 1e8 … 1e10
        # where the two opposite rows were taken as independent
        assert float(result.weights.abs().max()) <= 1e6


def test_weight_ratios_are_the_weights_against_the_bound() -> None:
    q = torch.tensor([[4.0, 1.0], [1.0, 1.0]], dtype=F64)  # ‖e₀‖_Q = 2, D = (2, 1)
    lower = torch.tensor([[1.0, 0.0], [0.5, 0.0], [0.0, 0.0]], dtype=F64)
    x = lower + torch.tensor([[3.0, 4.0], [0.0, 7.0], [0.0, 1e-3]], dtype=F64)
    # ‖(6, 4)‖/2, ‖(0, 7)‖/1; a zero bound with a non-zero weight: unbounded
    expected = [52**0.5 / 2, 7.0, float("inf")]
    assert weight_ratios(q, lower, x).tolist() == pytest.approx(expected)
