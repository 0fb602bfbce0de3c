"""UPGrad and DualProj: hand-built projections, preference, TorchJD agreement when available."""

from __future__ import annotations

import pytest
import torch

from gradbalance.balancers import DualProj, UPGrad
from support.balancers import random_matrix


def test_hand_built_two_tasks() -> None:
    g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    # π(g1/2): project (½,0) off g2 -> (¼,¼); π(g2/2): project (-½,½) off g1 -> (0,½).
    torch.testing.assert_close(UPGrad()(g), torch.tensor([0.25, 0.75], dtype=torch.float64))
    # Mean (0, ½) already has g1·m = 0, g2·m = ½: inside the dual cone, unchanged.
    torch.testing.assert_close(DualProj()(g), torch.tensor([0.0, 0.5], dtype=torch.float64))


def test_opposite_tasks_give_zero() -> None:
    g = torch.tensor([[1.0, 2.0], [-2.0, -4.0]], dtype=torch.float64)
    for b in (UPGrad(), DualProj()):
        torch.testing.assert_close(b(g), torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-12)


def test_preference_vector() -> None:
    g = random_matrix(2, 3, 6, conflict=False)
    g = g.abs()  # all pairwise inner products positive: nothing to project
    pref = [0.2, 0.3, 0.5]
    expected = torch.tensor(pref, dtype=torch.float64) @ g
    torch.testing.assert_close(UPGrad(pref=pref)(g), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(DualProj(pref=pref)(g), expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="pref"):
        UPGrad(pref=[1.0, -1.0])
    with pytest.raises(ValueError, match="pref"):
        DualProj(pref=[1.0, 1.0])(g)


@pytest.mark.parametrize(("k", "p", "seed"), [(3, 7, 0), (5, 30, 1), (4, 9, 3)])
def test_agrees_with_torchjd(k: int, p: int, seed: int) -> None:
    # TorchJD's projector needs quadprog (extra "quadprog_projector"); it also adds 1e-4 to the
    # diagonal of the trace-normalised Gramian, hence the 1e-3 relative tolerance. Full-rank
    # cases only: for K > P see test_rank_deficient_matches_exact_projection.
    pytest.importorskip("qpsolvers")
    pytest.importorskip("quadprog")
    import torchjd.aggregation as tjd

    g = random_matrix(seed, k, p)
    scale = float(g.norm())
    torch.testing.assert_close(UPGrad()(g), tjd.UPGrad()(g), rtol=1e-3, atol=1e-3 * scale)
    torch.testing.assert_close(DualProj()(g), tjd.DualProj()(g), rtol=1e-3, atol=1e-3 * scale)


def test_rank_deficient_matches_exact_projection() -> None:
    """K > P: six tasks in three dimensions whose dual cone is only {0}.

    TorchJD 0.18 regularises the Gramian (+1e-4 on the diagonal) and returns a small non-zero
    vector there, which conflicts with some task. The exact answer, checked against an
    independent SLSQP projection of each row gₖ/K onto {v : G v >= 0}, is the zero vector.
    """
    optimize = pytest.importorskip("scipy.optimize")
    g = random_matrix(2, 6, 3)
    m = g.numpy()
    reference = 0.0
    for row in m / 6:
        result = optimize.minimize(
            lambda v, t=row: ((v - t) ** 2).sum(), row * 0, jac=lambda v, t=row: 2 * (v - t),
            constraints=[{"type": "ineq", "fun": lambda v: m @ v, "jac": lambda v: m}],
            method="SLSQP", options={"ftol": 1e-15, "maxiter": 1000},
        )
        reference = reference + result.x
    expected = torch.as_tensor(reference, dtype=torch.float64)
    torch.testing.assert_close(UPGrad()(g), expected, rtol=0, atol=1e-9)
    assert float(expected.norm()) < 1e-9  # the cone is {0}: a property of this input
