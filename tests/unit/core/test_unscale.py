"""The one unscaling path (``_amp.unscaled_gramian``): local rows, a rank's columns, and a
Gramian of scaled losses give the true Gramian."""

from __future__ import annotations

import torch

from gradbalance._amp import unscaled_gramian
from gradbalance.balancers import Shard

SCALE = torch.tensor(4.0)


def test_rows_are_divided_in_place() -> None:
    matrix = torch.tensor([[4.0, 0.0], [0.0, 8.0]])
    gram = unscaled_gramian(SCALE, matrix=matrix)
    torch.testing.assert_close(matrix, torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    torch.testing.assert_close(gram, torch.tensor([[1.0, 0.0], [0.0, 4.0]], dtype=torch.float64))


def test_a_ranks_columns_are_summed_over_the_shard() -> None:
    """Three ranks holding the same columns [[1, 1], [0, 2]] (after unscaling): each partial
    Gramian [[2, 2], [2, 4]], summed: three times it."""
    matrix = torch.tensor([[4.0, 4.0], [0.0, 8.0]])
    shard = Shard(((0, 2),), 6, lambda t: t * 3)
    gram = unscaled_gramian(SCALE, matrix=matrix, shard=shard)
    torch.testing.assert_close(matrix, torch.tensor([[1.0, 1.0], [0.0, 2.0]]))
    torch.testing.assert_close(gram, torch.tensor([[6.0, 6.0], [6.0, 12.0]],
                                                  dtype=torch.float64))


def test_no_scale_leaves_the_rows() -> None:
    matrix = torch.tensor([[3.0, 4.0]])
    gram = unscaled_gramian(None, matrix=matrix, shard=Shard.whole(2))
    torch.testing.assert_close(matrix, torch.tensor([[3.0, 4.0]]))
    torch.testing.assert_close(gram, torch.tensor([[25.0]], dtype=torch.float64))


def test_a_gramian_of_scaled_losses_is_divided_by_the_squared_scale() -> None:
    gram = torch.tensor([[32.0, 16.0], [16.0, 64.0]], dtype=torch.float64)
    torch.testing.assert_close(unscaled_gramian(SCALE, gramian=gram),
                               torch.tensor([[2.0, 1.0], [1.0, 4.0]], dtype=torch.float64))
