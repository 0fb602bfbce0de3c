"""Random (RLW/RGW): agreement with TorchJD's Random and the weight distributions."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import RandomWeighting

from gradbalance.balancers import Random
from gradbalance.functional import random_weights


def test_matches_torchjd_random_under_the_same_seed() -> None:
    # TorchJD draws N(0, I) from the global RNG in the matrix dtype, then softmax; with the
    # same seed and float64 the draws are the same numbers: exact agreement.
    g = torch.randn(4, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ours = Random(generator=torch.Generator().manual_seed(7))
    torch.manual_seed(7)
    ref = RandomWeighting()
    expected = [ref(g) for _ in range(3)]
    for exp in expected:
        torch.testing.assert_close(ours.compute_weights(g @ g.T), exp, rtol=0, atol=0)


@pytest.mark.parametrize("distribution", ["normal", "uniform", "dirichlet"])
def test_weights_are_positive_and_sum_to_one(distribution: str) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        w = random_weights(5, distribution, gen)  # type: ignore[arg-type]
        assert bool((w > 0).all())
        torch.testing.assert_close(w.sum(), torch.tensor(1.0, dtype=torch.float64))


def test_uniform_logits_bound_the_weight_ratio() -> None:
    # softmax of z in [0, 1): any two weights differ by a factor below e.
    w = random_weights(6, "uniform", torch.Generator().manual_seed(2))
    assert float(w.max() / w.min()) < torch.e


def test_dirichlet_mean_is_uniform() -> None:
    # Dirichlet(1,1,1) has mean 1/3 per coordinate; the sd of a 4000-draw mean is ~0.004.
    gen = torch.Generator().manual_seed(3)
    draws = torch.stack([random_weights(3, "dirichlet", gen) for _ in range(4000)])
    torch.testing.assert_close(draws.mean(0), torch.full((3,), 1 / 3, dtype=torch.float64),
                               rtol=0, atol=0.02)


def test_invalid_distribution() -> None:
    with pytest.raises(ValueError, match="Invalid distribution: 'beta'"):
        Random(distribution="beta")  # type: ignore[arg-type]
