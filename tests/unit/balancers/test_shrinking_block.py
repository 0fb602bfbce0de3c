"""Block pivoting's shrinking block (:func:`~gradbalance.balancers._boxqp._block`).

Exchanging every infeasible index each iteration (Júdice & Pires 1994) cycles on badly
conditioned Gramians: rows of rank ``K/2`` plus noise of 1e-2 of their size (condition number
near 1e5), where Murty's rule after three chances finished 23 to 40 of UPGrad's 64
projections in 200 iterations. The rule here exchanges every index while their number falls
and once after, then half the last block, the most infeasible first; the answers are checked
against scipy's NNLS, an independent solver.
"""

from __future__ import annotations

import pytest
import torch
from tests.support.balancers import nnls_dual_cone
from tests.support.many_kinds import assert_same_update

from gradbalance.balancers import UPGrad, _boxqp
from gradbalance.balancers._solvers import trace_normalized

F64 = torch.float64


def _low_rank_noise(k: int, rank: int, noise: float, seed: int, p: int = 2000) -> torch.Tensor:
    """``[K, P]`` rows in a random span of ``rank`` plus Gaussian noise of relative size
    ``noise``: full rank, the Gramian's small eigenvalues all near ``noise²``."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(k, rank, generator=gen, dtype=F64) @ torch.randn(
        rank, p, generator=gen, dtype=F64) / rank**0.5
    return basis + noise * torch.randn(k, p, generator=gen, dtype=F64)


def _cosine_problems(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """UPGrad's K box problems on the trace-normalised cosine matrix (``lower = I``)."""
    k = rows.shape[0]
    q, _ = trace_normalized(rows @ rows.T)
    d = torch.diagonal(q).sqrt()
    return q / torch.outer(d, d) / k, torch.eye(k, dtype=F64)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize(("rank", "noise"), [(32, 1e-2), (16, 1e-3)])
def test_the_pivoting_finishes_badly_conditioned_projections(seed: int, rank: int,
                                                             noise: float) -> None:
    """K = 64: the factorised pivoting finishes at least 44 of the 64 projections within 200
    iterations (the old rule: 40, 23, 7 and 3 on rank 32; the others leave after
    ``STALE_MAX`` iterations without progress), each it finishes equal to scipy's
    projection."""
    rows = _low_rank_noise(64, rank, noise, seed)
    q, lower = _cosine_problems(rows)
    assert float(torch.linalg.cond(q)) > 1e3  # badly conditioned, as the docstring says
    got = _boxqp.solve_lcp_pivoting(q, torch.zeros_like(lower), lower, False,
                                    torch.zeros_like(lower, dtype=torch.bool), 1e-12, 200)
    assert got is not None
    x, done = got
    assert int(done.sum()) >= 44
    d = torch.diagonal(rows @ rows.T).sqrt()
    eye = torch.eye(64, dtype=F64)
    for i in torch.nonzero(done).flatten().tolist():  # x in the cosine variables: v = x / d
        assert_same_update((x[i] / d) @ rows, nnls_dual_cone(rows, eye[i] / d[i]), rows)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(("k", "rank", "noise"), [(64, 32, 1e-2), (96, 24, 1e-3),
                                                  (128, 32, 1e-3)])
def test_upgrad_on_low_rank_rows_with_noise(seed: int, k: int, rank: int, noise: float) -> None:
    """UPGrad's update on such rows is the sum of scipy's projections: the conjugate-gradient
    pivoting from 64 tasks (tight solves to ``CG_ERROR`` of each projection's own size,
    those that do not converge left to the factorisations), the factorised pivoting of the
    problems it leaves open with the multipliers tested against each projection's size
    (with ``−1e-12`` absolute, projections a thousandth of their bound on rank ``K/4`` plus
    noise 1e-3 finished 1e-5 off, the update 1e-4)."""
    rows = _low_rank_noise(k, rank, noise, seed)
    eye = torch.eye(k, dtype=F64)
    reference = sum(nnls_dual_cone(rows, eye[i] / k) for i in range(k))
    assert isinstance(reference, torch.Tensor)
    assert_same_update(UPGrad().combine(rows).vector, reference, rows)


def test_the_block_shrinks_as_documented() -> None:
    """Counts 10, 12, 14, 9, 11, 13, 15, 16, 17: every index while the count falls and once
    after (10, 12; 9, 11), then half the last block down to one; the same for one problem."""
    counts = [10, 12, 14, 9, 11, 13, 15, 16, 17]
    sizes = [10, 12, 6, 9, 11, 5, 2, 1, 1]
    best, size, stale = torch.tensor([65]), torch.tensor([64]), torch.tensor([0])
    b1, s1, t1 = 65, 64, 0
    for count, expected in zip(counts, sizes, strict=True):
        best, size, stale = _boxqp._block(torch.tensor([count]), best, size, stale)
        b1, s1, t1 = _boxqp._block_single(count, b1, s1, t1)
        assert int(size) == expected == s1
        assert int(best) == b1 and int(stale) == t1
    assert t1 == 5  # five iterations since the best (9)


@pytest.mark.parametrize(("size", "murty", "flipped"),
                         [(2, False, [3, 4]), (3, False, [0, 3, 4]), (4, False, [0, 1, 3, 4]),
                          (9, False, [0, 1, 3, 4]), (2, True, [4])])
def test_the_most_infeasible_change_side(size: int, murty: bool, flipped: list[int]) -> None:
    """Free indices 0–2 with ``y = (−1, −0.2, 2)``, fixed 3–4 with ``w = (−3, −4)``: against
    the largest ``|y|`` (2) and ``|w|`` (4) the infeasibilities are 0.5, 0.1, 0.75, 1, so
    the block takes 4, 3, 0, 1 in that order; Murty's rule takes the largest index."""
    free = [True, True, True, False, False]
    y = [-1.0, -0.2, 2.0, 0.0, 0.0]
    w = [0.0, 0.0, 0.0, -3.0, -4.0]
    bad = [0, 1, 3, 4]
    mask = torch.tensor([[i in bad for i in range(5)]])
    got = _boxqp._exchange(torch.tensor([free]), mask, torch.tensor([size]),
                           torch.tensor([murty]), False, torch.tensor([y], dtype=F64),
                           torch.tensor([w], dtype=F64))
    single = list(free)
    _boxqp._exchange_single(single, bad, size, murty, False, y, w)
    expected = [f != (i in flipped) for i, f in enumerate(free)]
    assert got[0].tolist() == expected == single
