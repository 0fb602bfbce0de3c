"""GradDrop: the sign-purity rule by hand, and agreement with TorchJD's GradDrop."""

from __future__ import annotations

import pytest
import torch
from torchjd.aggregation import GradDrop as TorchJDGradDrop

from gradbalance.balancers import GradDrop
from gradbalance.functional import graddrop_update


@pytest.mark.parametrize("leak", [None, [0.1, 0.0, 0.5, 1.0]])
def test_matches_torchjd_under_the_same_seed(leak: list[float] | None) -> None:
    # TorchJD draws U ~ U(0,1)^P from the global RNG; a generator with the same seed gives the
    # same draws, so the outputs agree exactly.
    g = torch.randn(4, 200, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    lk = None if leak is None else torch.tensor(leak, dtype=torch.float64)
    torch.manual_seed(3)
    expected = TorchJDGradDrop(leak=lk)(g)
    ours = GradDrop(leak=leak, generator=torch.Generator().manual_seed(3))(g)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


def test_hand_derived_two_opposing_tasks() -> None:
    # Coordinate 0: g = (1, -3): purity P = ½(1 + (-2)/4) = 0.25. U < P keeps the positive
    # part (1), U > P the negative part (-3). Coordinate 1: both positive, P = 1: always kept.
    g = torch.tensor([[1.0, 2.0], [-3.0, 5.0]], dtype=torch.float64)
    low = graddrop_update(g, torch.tensor([0.2, 0.99], dtype=torch.float64))
    high = graddrop_update(g, torch.tensor([0.3, 0.99], dtype=torch.float64))
    torch.testing.assert_close(low, torch.tensor([1.0, 7.0], dtype=torch.float64))
    torch.testing.assert_close(high, torch.tensor([-3.0, 7.0], dtype=torch.float64))


def test_positive_side_is_kept_with_probability_purity() -> None:
    g = torch.tensor([[1.0], [-3.0]], dtype=torch.float64).repeat(1, 20000)
    out = GradDrop(generator=torch.Generator().manual_seed(0))(g)
    frac = float((out > 0).double().mean())
    assert abs(frac - 0.25) < 0.015  # binomial sd ≈ 0.003


def test_full_leak_is_the_plain_sum_and_zero_columns_stay_zero() -> None:
    g = torch.randn(3, 50, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    g[:, :5] = 0
    out = GradDrop(leak=[1.0, 1.0, 1.0], generator=torch.Generator().manual_seed(0))(g)
    torch.testing.assert_close(out, g.sum(0))
    dropped = GradDrop(generator=torch.Generator().manual_seed(0))(g)
    assert bool((dropped[:5] == 0).all())


def test_invalid_leak() -> None:
    with pytest.raises(ValueError, match="Invalid leak"):
        GradDrop(leak=[0.5, 1.5])
    with pytest.raises(ValueError, match="Invalid leak"):
        GradDrop(num_tasks=3, leak=[0.5, 0.5])
