"""CAGrad where the norms lie decades apart and the cosine matrix is singular.

Parallel rows of unequal lengths (a task and a longer or shorter copy of it), rows in a span
of fewer dimensions than tasks, and zero rows among them: the cosine matrix has null
directions, so the search cannot run on its Cholesky factor, and on ``G`` itself its
tolerances, relative to the longest row's terms, do not see the shortest rows' (the update
was off the primal's optimum by cosine 0.88–0.99, a task's ``gₖ·d`` at ``−0.9`` where the
optimum gives every task ``+0.47``). The reference and the checks are
``test_cagrad_scaled.py``'s: the primal as an SOCP by Clarabel, the update judged by the
primal's own constraints and value.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gradbalance.balancers import CAGrad
from support.balancers import check_cagrad_zero_optimum

from .test_cagrad_scaled import _assert_primal, _primal

F64 = torch.float64


def _singular_rows(k: int, p: int, decades: float, kind: str, seed: int) -> torch.Tensor:
    """``K`` float64 rows of norms spread over ``decades``: ``copies`` (``K/2`` directions
    each given twice, the copies of unequal length), ``span`` (rows in ``⌈K/2⌉``
    dimensions), or ``zeros`` (``copies`` with two rows zero)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "span":
        rows = torch.randn(k, (k + 1) // 2, generator=gen, dtype=F64) @ torch.randn(
            (k + 1) // 2, p, generator=gen, dtype=F64)
    else:
        base = torch.randn(k - k // 2, p, generator=gen, dtype=F64)
        rows = torch.cat([base, base[: k // 2]])[torch.randperm(k, generator=gen)]
    scales = 10.0 ** ((torch.rand(k, generator=gen, dtype=F64) - 0.5) * decades)
    rows = rows * scales[:, None]
    if kind == "zeros":
        rows[:2] = 0.0
    return rows


def _check(rows: torch.Tensor, c: float) -> bool:
    """``_assert_primal`` against the reference; with zero rows where the optimum is 0 (every
    task can be kept from conflict), the dual's ``g_w = 0`` and the update the conflict-free
    one closest to ``g₀`` (:func:`~gradbalance.functional.cagrad_weights`;
    :func:`~support.balancers.check_cagrad_zero_optimum`)."""
    update = CAGrad(c=c)(rows)
    if bool((rows == 0.0).all(dim=1).any()) and check_cagrad_zero_optimum(rows, update, 1e-7, c):
        return True
    return _assert_primal(update, _primal(rows, c), rows, c)


@settings(max_examples=25, deadline=None)
@given(st.integers(4, 40), st.sampled_from(["copies", "span", "zeros"]), st.integers(4, 8),
       st.sampled_from([0.2, 0.4, 0.8]), st.integers(0, 2**16))
def test_a_singular_cosine_matrix_with_norms_decades_apart_gives_the_primals_update(
        k: int, kind: str, decades: int, c: float, seed: int) -> None:
    rows = _singular_rows(k, 2 * k + 10, float(decades), kind, seed)
    assume(_check(rows, c))


@pytest.mark.parametrize("kind", ["copies", "span", "zeros"])
@pytest.mark.parametrize("k", [16, 40, 70])
def test_singular_cases_meet_the_primal(kind: str, k: int) -> None:
    # fixed cases, 70 tasks among them (the search's factor cut at its rounding from 64)
    for seed in range(3):
        rows = _singular_rows(k, 2 * k + 10, 8.0, kind, seed)
        assert _check(rows, 0.4), seed
