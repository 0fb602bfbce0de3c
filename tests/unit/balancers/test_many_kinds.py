"""Every balancer on every kind of rows of the many-task check, and the pairwise passes
against their loops on those kinds.

Kinds (``support.many_kinds``, as ``benchmarks/many_tasks.py``): conflicting rows, near
duplicates of 4 directions (1e-6 apart), norms spanning 1e-6 … 1e6, rank 1, rank 8, all
aligned, half zero, and a mix. The passes' tolerance is ``test_many_tasks.py``'s: the same
update, cosine ≥ 0.999999 and norm within 1e-6 relative (a cancelling update within
``1e-8 Σₖ‖gₖ‖``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance.balancers import BALANCERS, _pairwise
from support.balancers import build_balancer
from support.many_kinds import KIND_NAMES, check_gradvac_pass, check_pcgrad_pass, kind_rows

F64 = torch.float64
#: K up to 24 (the loops are O(K⁴) in Python); ``test_many_tasks.py`` runs its kinds to 64.
CASES = st.tuples(st.integers(2, 24), st.sampled_from(KIND_NAMES), st.integers(0, 2**16))
#: (steps per block, sparse cost, columns per tile of the refreshed dots: 10**6, one tile)
PASSES = st.tuples(st.sampled_from([1, 5, 16, 32]), st.sampled_from([0, 10**9]),
                   st.sampled_from([10**6, 1, 3, 8]))


pytestmark = pytest.mark.usefixtures("one_thread")  # K ≤ 100: one thread is faster


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_every_balancer_is_finite_on_every_kind(kind: str) -> None:
    """K = 12 float32 rows: a finite update from every registered balancer (Nash-MTL by its
    ridge where a non-negative combination of the rows vanishes, with a warning)."""
    g = kind_rows(kind, 12, 40, 3).to(torch.float32)
    losses = torch.rand(12, generator=torch.Generator().manual_seed(3)) + 0.5
    for name in BALANCERS:
        balancer = build_balancer(name, 12, seed=3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # FairGrad, Nash-MTL: no solution
            out = balancer.combine(g, losses if balancer.needs_losses else None).vector
        assert out.shape == (40,) and bool(torch.isfinite(out).all()), (name, kind)


@settings(max_examples=15, deadline=None)
@given(CASES, PASSES)
def test_pcgrad_pass_matches_the_loop_on_every_kind(case: tuple[int, str, int],
                                                    how: tuple[int, int, int]) -> None:
    k, kind, seed = case
    check_pcgrad_pass(kind_rows(kind, k, 2 * k + 3, seed), seed, how)


@settings(max_examples=10, deadline=None)
@given(CASES, st.floats(0.0, 1.0), PASSES)
def test_gradvac_pass_matches_the_pair_loop_on_every_kind(case: tuple[int, str, int],
                                                          beta: float,
                                                          how: tuple[int, int, int]) -> None:
    k, kind, seed = case
    check_gradvac_pass(kind_rows(kind, k, 2 * k + 3, seed), seed, beta, how)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 48), st.integers(1, 12), st.floats(0.0, 1.0), st.integers(0, 2**16),
       st.sampled_from([0, 10**9]), st.integers(1, 60))
def test_sparse_refresh_is_the_dense_product(k: int, n: int, live: float, seed: int,
                                             cost: int, width: int) -> None:
    """``cg + Δ G`` with ``Δ[i, cols[i, s]] = w[i, s]`` (distinct columns per row, a share of
    the weights zero, whole rows zero included), CSR (``SPARSE_COST`` 0) and the dense
    product (a cost no sparse product undercuts) against the dense ``Δ`` written out, on
    column tiles of ``width`` (one tile where it is at least K) read back entry by entry
    through :func:`~gradbalance.balancers._pairwise.tiled_index`; the pass hands ``cols``
    and ``w`` step by task, ``[n, K]``."""
    n = min(n, k)
    gen = torch.Generator().manual_seed(seed)
    gram = torch.randn(k, k, generator=gen, dtype=F64)
    cols = torch.stack([torch.randperm(k, generator=gen)[:n] for _ in range(k)])
    w = torch.randn(k, n, generator=gen, dtype=F64)
    w = w * (torch.rand(k, n, generator=gen, dtype=F64) < live)
    delta = torch.zeros(k, k, dtype=F64)
    for i in range(k):
        for s in range(n):
            delta[i, cols[i, s]] = w[i, s]
    cg = torch.randn(k, k, generator=gen, dtype=F64)
    expected = cg + delta @ gram
    flat, cg_tiles = _pairwise.column_tiles(cg.clone(), width)
    gram_tiles = _pairwise.column_tiles(gram, width)[1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_pairwise, "SPARSE_COST", cost)
        _pairwise._refresh(cg_tiles, gram_tiles, cols.T, w.T)
    base, stride = _pairwise.tiled_index(k, k, width, flat.device)
    read = torch.stack([flat[base + i * stride] for i in range(k)])
    torch.testing.assert_close(read, expected, rtol=1e-12, atol=1e-12)
