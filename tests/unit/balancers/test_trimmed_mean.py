"""TrimmedMean: hand-derived columns and agreement with TorchJD's TrimmedMean."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import TrimmedMean as TorchJDTrimmedMean

from gradbalance.balancers import TrimmedMean
from gradbalance.functional import trimmed_mean_update


@pytest.mark.parametrize("t", [0, 1, 2])
def test_matches_torchjd(t: int) -> None:
    g = torch.randn(5, 40, generator=torch.Generator().manual_seed(t), dtype=torch.float64)
    torch.testing.assert_close(TrimmedMean(trim_number=t)(g), TorchJDTrimmedMean(t)(g),
                               rtol=0, atol=0)


def test_hand_derived_columns() -> None:
    g = torch.tensor([[1.0, -7.0], [2.0, 0.0], [100.0, 3.0], [-5.0, 1.0], [3.0, 2.0]])
    # column 0 sorted: -5, 1, 2, 3, 100 -> trim 1: mean(1, 2, 3) = 2
    # column 1 sorted: -7, 0, 1, 2, 3 -> trim 1: mean(0, 1, 2) = 1; trim 2: 1
    torch.testing.assert_close(trimmed_mean_update(g, 1), torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(trimmed_mean_update(g, 2), torch.tensor([2.0, 1.0]))
    torch.testing.assert_close(trimmed_mean_update(g, 0), g.mean(0))


def test_too_few_tasks() -> None:
    with pytest.raises(ValueError, match="Invalid trim_number: 2"):
        TrimmedMean(num_tasks=4, trim_number=2)
    with pytest.raises(ValueError, match="at least 5 tasks"):
        TrimmedMean(trim_number=2)(torch.randn(4, 3))
