"""PCD on a singular secondary Gramian from 64 tasks on (the least-distance program on the
factor cut at the rounding, docs/balancers.md "Solvers"): against scipy's NNLS of the same
program on the rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.functional import pcd_weights
from gradbalance.gramian import compute_gramian
from support.balancers import scipy_pcd

F64 = torch.float64
TAU = 0.02


pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 100: one thread is faster


def _span(k: int, rank: int, seed: int) -> Tensor:
    """``[K, 2K + 3]`` float64 unit rows in a random span of ``rank``."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, rank, generator=gen, dtype=F64) @ torch.randn(rank, 2 * k + 3,
                                                                     generator=gen, dtype=F64)
    return g / g.norm(dim=1, keepdim=True)


def _assert_same_direction(d: Tensor, ref: Tensor) -> None:
    assert float(d @ ref) / float(d.norm() * ref.norm()) >= 0.999999
    assert abs(float(d.norm() - ref.norm())) <= 1e-6 * float(ref.norm())


@settings(max_examples=30, deadline=None)
@given(st.integers(64, 66), st.integers(1, 63), st.integers(0, 2**16))
def test_singular_secondary_gramian_is_scipys(k: int, rank: int, seed: int) -> None:
    """float64 unit rows in a span of rank below ``K − 1``: ``d = g₁ + Σ μⱼgⱼ`` is scipy's
    (cosine ≥ 0.999999, norm within 1e-6), feasible or not."""
    g = _span(k, rank, seed)
    mult = pcd_weights(g @ g.T, torch.full((k - 1,), TAU, dtype=F64))
    _assert_same_direction(mult @ g, scipy_pcd(g, TAU))


@settings(max_examples=20, deadline=None)
@given(st.integers(64, 66), st.integers(1, 8), st.integers(0, 2**16))
def test_rounded_gramian_of_a_low_span_keeps_the_primary(k: int, rank: int,
                                                         seed: int) -> None:
    """Rows in a span of rank at most 8 (``0`` in the hull of the secondary rows, as scipy
    finds on the float64 rows) rounded to float32: no direction of the span meets every
    constraint, so ``d = g₁``; the float32 Gramian's rounding-level eigenvalues are cut, not
    taken for directions that meet them."""
    rows = _span(k, rank, seed)
    ref = scipy_pcd(rows, TAU)
    assert torch.equal(ref, rows[0])
    mult = pcd_weights(compute_gramian(rows.to(torch.float32)).to(F64),
                       torch.full((k - 1,), TAU, dtype=F64))
    _assert_same_direction(mult @ rows, ref)
