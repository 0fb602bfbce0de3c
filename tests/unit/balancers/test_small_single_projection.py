"""DualProj's single projection (the one-problem pivoting, :func:`~._boxqp._pivot_single`)
where the projection is far smaller than its bound: rows of low rank plus noise ``1e-4``
(the Gramian's condition number near 1e9), against scipy's NNLS on the rows
(``support.cone_reference``). Against an absolute multiplier tolerance the pivoting
finished such a problem with an update 3–11 % off and a conflict of ``−1e-5`` of its size
with one task; its multipliers are now tested against the point's own size."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from gradbalance.functional import dualproj_weights
from gradbalance.gramian import compute_gramian
from support.cone_reference import scipy_projection
from support.many_kinds import assert_same_update

F64 = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def _low_rank_plus_noise(k: int, rank: int, p: int, seed: int) -> Tensor:
    """``[K, P]`` float64: ``K`` rows in a span of ``rank`` plus noise ``1e-4`` of their size."""
    gen = torch.Generator().manual_seed(seed)
    span = torch.randn(k, rank, generator=gen, dtype=F64) @ torch.randn(
        rank, p, generator=gen, dtype=F64) / rank**0.5
    return span + 1e-4 * torch.randn(k, p, generator=gen, dtype=F64)


@pytest.mark.parametrize(("k", "rank", "p", "seed"),
                         [(64, 4, 1500, 0), (64, 8, 600, 3), (96, 32, 2000, 2),
                          (128, 16, 3000, 1), (200, 25, 4000, 1)])
def test_a_small_projection_of_low_rank_rows_is_scipys(k: int, rank: int, p: int,
                                                       seed: int) -> None:
    """The update ``Jᵀw`` is scipy's projection of the mean (cosine ≥ 0.999999, norm within
    1e-6) and conflicts with no task beyond ``1e-9`` of its size times the task's, though it
    is about 1e-4 of the mean's size."""
    g = _low_rank_plus_noise(k, rank, p, seed)
    pref = torch.full((k,), 1.0 / k, dtype=F64)
    update = dualproj_weights(compute_gramian(g)) @ g
    expected = scipy_projection(g, pref)
    assert float(expected.norm()) < 1e-2 * float((pref @ g).norm())  # far inside the bound
    assert_same_update(update, expected, g)
    cosines = g @ update / (g.norm(dim=1) * update.norm())
    assert float(cosines.min()) >= -1e-9
