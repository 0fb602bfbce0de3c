"""PCD: agreement with TorchJD's PCD over steps, a hand-derived constraint, infeasibility."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import PCDWeighting

from gradbalance.balancers import PCD
from gradbalance.functional import pcd_weights


@pytest.mark.parametrize("tau", [0.02, 0.5])
def test_matches_torchjd_over_steps(tau: float) -> None:
    # TorchJD solves the same QP with a dual active-set method; we enumerate working sets.
    gen = torch.Generator().manual_seed(0)
    ours, ref = PCD(tau=tau, beta=0.9), PCDWeighting(tau=tau, beta=0.9)
    for _ in range(5):
        g = torch.randn(4, 6, generator=gen, dtype=torch.float64)
        g[0] *= 3
        a = g @ g.T
        torch.testing.assert_close(ours.compute_weights(a), ref(a), rtol=1e-9, atol=1e-12)


def test_hand_derived_orthogonal_secondary() -> None:
    # g1 = (2, 0), g2 = (0, 1) (unit normalised Gramian): g2ᵀg1 = 0 < τ‖g2‖², so the
    # constraint is active: d = g1 + μ g2 with g2ᵀd = μ = τ.
    gram = torch.tensor([[4.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(pcd_weights(gram, torch.tensor([0.3], dtype=torch.float64)),
                               torch.tensor([1.0, 0.3], dtype=torch.float64))
    # A satisfied constraint (g2 aligned with g1) stays inactive: d = g1.
    aligned = torch.tensor([[4.0, 2.0], [2.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(pcd_weights(aligned, torch.tensor([0.3],
                                                                     dtype=torch.float64)),
                               torch.tensor([1.0, 0.0], dtype=torch.float64))


def test_infeasible_constraints_fall_back_to_the_primary() -> None:
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, -1.0]], dtype=torch.float64)
    out = PCD(tau=0.1)(g)
    torch.testing.assert_close(out, g[0])


def test_invalid_tau() -> None:
    with pytest.raises(ValueError, match=r"Invalid tau: 1\.5"):
        PCD(tau=1.5)
    with pytest.raises(ValueError, match="secondary tasks"):
        PCD(tau=[0.1, 0.2])(torch.randn(2, 3))
