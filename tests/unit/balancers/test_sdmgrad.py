"""SDMGrad: agreement with TorchJD's SDMGradWeighting; the limits of λ."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import SDMGradWeighting

from gradbalance.balancers import SDMGrad


def test_matches_torchjd_over_steps() -> None:
    # Same recursion; TorchJD divides A by (s² + 1e-8) where we divide by s² exactly, and the
    # 20 momentum steps amplify that 1e-10 relative difference to ~1e-6 at most.
    gen = torch.Generator().manual_seed(0)
    ours, ref = SDMGrad(), SDMGradWeighting(lr=5.0, momentum=0.5, n_iter=20, lambda_=0.3)
    for _ in range(5):
        g = torch.randn(4, 30, generator=gen, dtype=torch.float64)
        a = g @ g.T
        torch.testing.assert_close(ours.compute_weights(a), ref(a), rtol=0, atol=1e-5)


def test_large_lambda_tends_to_the_preference_and_weights_sum_to_one() -> None:
    g = torch.randn(3, 12, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    w = SDMGrad(lambda_=1e6, pref_vector=[0.2, 0.3, 0.5]).compute_weights(g @ g.T)
    torch.testing.assert_close(w, torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64),
                               rtol=0, atol=1e-5)
    w0 = SDMGrad(lambda_=0.3).compute_weights(g @ g.T)
    torch.testing.assert_close(w0.sum(), torch.tensor(1.0, dtype=torch.float64))
    assert bool((w0 >= 0).all())


def test_lambda_zero_approaches_the_min_norm_point() -> None:
    # λ = 0: projected SGD on ½‖Gᵀw‖² over the simplex (MGDA's problem). Two tasks with
    # g1 = (1, 0), g2 = (0, 2): the min-norm point is w = (0.8, 0.2).
    g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
    b = SDMGrad(lambda_=0.0, lr=0.1, n_iter=300)  # a small step: the default lr overshoots
    torch.testing.assert_close(b.compute_weights(g @ g.T), torch.tensor([0.8, 0.2],
                                                                 dtype=torch.float64))


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="Invalid momentum: 1"):
        SDMGrad(momentum=1.0)
    with pytest.raises(ValueError, match="Invalid pref_vector"):
        SDMGrad(num_tasks=2, pref_vector=[0.5, 0.3, 0.2])
