"""Krum / Multi-Krum: the outlier is never picked; agreement with TorchJD's Krum."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import KrumWeighting

from gradbalance.balancers import Krum
from gradbalance.functional import krum_weights


@pytest.mark.parametrize(("f", "m"), [(0, 1), (1, 1), (1, 2), (2, 3)])
def test_matches_torchjd(f: int, m: int) -> None:
    g = torch.randn(6, 20, generator=torch.Generator().manual_seed(f + 10 * m),
                    dtype=torch.float64)
    a = g @ g.T
    torch.testing.assert_close(krum_weights(a, f, m), KrumWeighting(f, m)(a), rtol=0, atol=0)


def test_hand_derived_cluster_and_outlier() -> None:
    # Rows 0-2 lie within 0.1 of (1, 0), row 3 at (-50, 0). With f = 1 each score sums the
    # K - f - 2 = 1 nearest distance: the cluster's are ≤ 0.2, the outlier's ≈ 51.
    g = torch.tensor([[1.0, 0.0], [1.0, 0.1], [1.05, 0.0], [-50.0, 0.0]], dtype=torch.float64)
    w = Krum(n_byzantine=1, n_selected=3).combine(g).weights
    assert w is not None and float(w[3]) == 0.0
    torch.testing.assert_close(w[:3], torch.full((3,), 1 / 3, dtype=torch.float64))
    # Krum (m = 1): distances 0↔1 = 0.1, 0↔2 = 0.05, 1↔2 ≈ 0.112: row 0 is the most central.
    w1 = krum_weights(g @ g.T, 1, 1)
    torch.testing.assert_close(w1, torch.tensor([1.0, 0, 0, 0], dtype=torch.float64))


def test_too_few_tasks() -> None:
    with pytest.raises(ValueError, match="Invalid num_tasks: 3"):
        Krum(num_tasks=3, n_byzantine=1)
    with pytest.raises(ValueError, match="needs at least 4"):
        Krum(n_byzantine=1)(torch.randn(3, 5))


def test_mutual_nearest_rows_tie_exactly_whatever_the_gramians_rounding() -> None:
    """Rows 1 and 2 are each other's nearest (K = 3: one neighbour per score), so their
    scores are both ``d₁₂``: a tie, which goes to the lower index. A Gramian whose ``G₁₂``
    and ``G₂₁`` differ in the last bits (a product that is not symmetric bit for bit, as some
    BLAS kernels leave it) must not decide it."""
    g = torch.tensor([[10.0, 0.0], [1.0, 1.0], [1.5, 1.0]], dtype=torch.float64)
    gram = g @ g.T
    for ulps in (1, -1, 3):
        skewed = gram.clone()
        skewed[2, 1] = gram[2, 1] + ulps * torch.finfo(torch.float64).eps * gram[2, 1]
        assert krum_weights(skewed).tolist() == [0.0, 1.0, 0.0]
        assert krum_weights(skewed.T.contiguous()).tolist() == [0.0, 1.0, 0.0]
