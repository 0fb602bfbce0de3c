"""ConFIG where ``g_u = U⁺1`` vanishes: every task given with a negative of it (``g``,
``−c·g``), so ``Uᵀ1 = 0`` and ``U⁺1 = 0`` exactly. The update was one the rounding drew, of
the rows' size (norm 88 against rows of 60 at K = 64, float64); it is zero. Where one task
has no negative ``g_u`` is not zero, and the update is numpy's ``pinv`` form."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradbalance.balancers import ConFIG


def _negated(k: int, p: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((k // 2, p))
    c = 10 ** rng.uniform(-1, 1, (k // 2, 1))
    return np.concatenate([base, -c * base])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("k", "seed"), [(4, 0), (16, 1), (64, 2), (130, 3)])
def test_every_task_with_its_negative_gives_no_update(k: int, seed: int,
                                                      dtype: torch.dtype) -> None:
    rows = _negated(k, 300, seed)
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    assert np.linalg.norm(unit.T @ np.ones(k)) < 1e-12 * k  # g_u = U⁺1 = 0: the premise
    out = ConFIG().combine(torch.tensor(rows, dtype=dtype))
    assert torch.count_nonzero(out.vector) == 0
    assert torch.count_nonzero(out.weights) == 0


@pytest.mark.parametrize(("k", "seed"), [(5, 0), (17, 1), (65, 2)])
def test_one_task_without_a_negative_gives_the_pinv_form(k: int, seed: int) -> None:
    rows = np.concatenate([_negated(k - 1, 300, seed),
                           np.random.default_rng(seed + 100).standard_normal((1, 300))])
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    g_u = np.linalg.pinv(unit, rcond=1e-10) @ np.ones(k)
    direction = g_u / np.linalg.norm(g_u)
    expected = (rows @ direction).sum() * direction
    got = ConFIG().combine(torch.tensor(rows)).vector.numpy()
    assert np.linalg.norm(got - expected) <= 1e-9 * np.linalg.norm(expected)
