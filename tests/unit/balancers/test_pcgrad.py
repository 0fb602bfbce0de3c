"""PCGrad: hand-built case, TorchJD 0.18 agreement, reduction, resumable task orders."""

from __future__ import annotations

import pytest
import torch
import torchjd.aggregation as tjd

from gradbalance.balancers import PCGrad
from support.balancers import random_matrix


def test_hand_built_two_tasks() -> None:
    g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
    # g1 off g2: (1,0) + ½(-1,1) = (½,½); g2 off g1: (-1,1) + (1,0) = (0,1).
    torch.testing.assert_close(PCGrad()(g), torch.tensor([0.5, 1.5], dtype=torch.float64))
    mean = PCGrad(reduction="mean")(g)
    torch.testing.assert_close(mean, torch.tensor([0.25, 0.75], dtype=torch.float64))


def test_no_conflict_is_the_sum() -> None:
    g = torch.tensor([[1.0, 0.2, 0.0], [0.5, 1.0, 0.1], [0.1, 0.0, 2.0]], dtype=torch.float64)
    torch.testing.assert_close(PCGrad()(g), g.sum(dim=0), rtol=0, atol=0)


@pytest.mark.parametrize(("k", "p", "seed"), [(2, 3, 0), (3, 7, 1), (5, 4, 2), (6, 30, 3)])
def test_agrees_with_torchjd(k: int, p: int, seed: int) -> None:
    # Same draws: TorchJD calls torch.randperm(K) per task on the global generator; ours on a
    # generator seeded with the same seed. Difference: rounding only.
    g = random_matrix(seed, k, p)
    torch.manual_seed(seed)
    expected = tjd.PCGrad()(g)
    ours = PCGrad(generator=torch.Generator().manual_seed(seed))(g)
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)


def test_resume_is_bit_identical() -> None:
    a = PCGrad(num_tasks=4, generator=torch.Generator().manual_seed(5))
    mats = [random_matrix(i, 4, 6) for i in range(6)]
    for m in mats[:3]:
        a(m)
    saved = a.state_dict()
    tail = [a(m) for m in mats[3:]]
    b = PCGrad(num_tasks=4, generator=torch.Generator().manual_seed(123))
    b.load_state_dict(saved)
    for m, expected in zip(mats[3:], tail):
        assert torch.equal(b(m), expected)


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="reduction"):
        PCGrad(reduction="max")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="generator"):
        PCGrad().load_state_dict({"_extra_state": {"_type": "PCGrad", "targets": None}})
