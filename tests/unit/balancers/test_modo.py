"""MoDo: agreement with TorchJD's MoDoWeighting over several steps; simplex weights."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import MoDoWeighting

from gradbalance.balancers import MoDo
from gradbalance.functional import modo_step


def test_matches_torchjd_over_steps() -> None:
    # TorchJD's MoDo takes the (cross-)Gramian; with A = G Gᵀ both run the same recursion.
    gen = torch.Generator().manual_seed(0)
    ours, ref = MoDo(gamma=0.01, rho=0.1), MoDoWeighting(gamma=0.01, rho=0.1)
    for _ in range(6):
        g = torch.randn(4, 10, generator=gen, dtype=torch.float64)
        a = g @ g.T
        w = ours.compute_weights(a)
        torch.testing.assert_close(w, ref(a), rtol=0, atol=1e-12)
        assert bool((w >= 0).all())
        torch.testing.assert_close(w.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_hand_derived_step() -> None:
    # λ = (½, ½), A = diag(1, 3), γ = 0.1, ρ = 0: λ - γAλ = (0.45, 0.35), already summing to
    # 0.8; the simplex projection adds 0.1 to each: (0.55, 0.45).
    lam = torch.tensor([0.5, 0.5], dtype=torch.float64)
    a = torch.diag(torch.tensor([1.0, 3.0], dtype=torch.float64))
    torch.testing.assert_close(modo_step(lam, a, 0.1, 0.0),
                               torch.tensor([0.55, 0.45], dtype=torch.float64))


def test_invalid_gamma() -> None:
    with pytest.raises(ValueError, match="Invalid gamma: 0"):
        MoDo(gamma=0.0)
