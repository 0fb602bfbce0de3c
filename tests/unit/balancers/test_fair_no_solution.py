"""Nash-MTL and FairGrad where their equation ``G w = w^{-p}`` has no solution, and near it.

No solution exists exactly when a non-negative combination of the non-zero task gradients
vanishes (docs/balancers.md, "Solvers"). The rows below plant one: ``g_last = −Σ cᵢgᵢ``,
``c > 0``, so ``u = (c, 1) ≥ 0`` has ``Jᵀu = 0`` by construction (the independent
certificate), then are rounded to float32 as a model's gradients are. Nash-MTL must raise its
``SolverError`` with nothing moved when asked (``no_solution="raise"``) and otherwise warn and
solve the ridge's equation ``((G + εI) α)ᵢ = 1/αᵢ``; FairGrad must warn with finite weights;
both stop within a few Newton steps of the iterate stalling rather than run all
``max_iter``. With the planted combination lifted off zero (``+ ε`` noise, a solution
exists) the defining equation holds. Each test runs twice: as given, and with the early
Newton steps in float32 from two tasks on (``FAIR_LOW_PRECISION_MIN_SIZE``, 256 by default),
where a float32 factorisation is then seen.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance import SolverError
from gradbalance.balancers import FairGrad, NashMTL, _solvers

F64 = torch.float64


def planted_rows(k: int, rank: int, eps: float, zeros: int, seed: int) -> Tensor:
    """``[K, 64]`` float32-rounded rows, as float64: ``K − 1 − zeros`` rows in a random
    ``rank``-dimensional span (norms over 4 decades), then ``−Σ cᵢgᵢ + ε·noise`` (``c > 0``),
    then ``zeros`` zero rows."""
    gen = torch.Generator().manual_seed(seed)
    n = k - 1 - zeros
    g = torch.randn(n, rank, generator=gen, dtype=F64) @ torch.randn(rank, 64, generator=gen,
                                                                      dtype=F64)
    g = g * torch.logspace(-2, 2, n, dtype=F64)[torch.randperm(n, generator=gen), None]
    c = torch.rand(n, 1, generator=gen, dtype=F64) + 0.1
    last = -(c * g).sum(0)
    last = last + eps * float(last.norm()) * torch.randn(64, generator=gen, dtype=F64) / 8
    rows = torch.cat([g, last[None], torch.zeros(zeros, 64, dtype=F64)])
    return rows[torch.randperm(k, generator=gen)].float().double()


def same(a: Any, b: Any) -> bool:
    """Bit-identical nested state (dicts, tensors, plain values)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[x], b[x]) for x in a)
    if isinstance(a, Tensor):
        return isinstance(b, Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return bool(a == b)


class Precision:
    """The float32 Newton steps forced from two tasks on (``low``), and the dtypes of the
    Cholesky factorisations :mod:`~gradbalance.balancers._solvers` ran (below 512 tasks only
    the float32 steps factorise: the float64 ones take the LU solve)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, low: bool) -> None:
        self.low = low
        self.dtypes: list[torch.dtype] = []
        if low:
            monkeypatch.setattr(_solvers, "FAIR_LOW_PRECISION_MIN_SIZE", 2)
        real = _solvers.cholesky_ex

        def spy(a: Tensor) -> Any:
            self.dtypes.append(a.dtype)
            return real(a)

        monkeypatch.setattr(_solvers, "cholesky_ex", spy)

    def check(self) -> None:
        """Float32 factorisations ran exactly where forced."""
        assert (torch.float32 in self.dtypes) is self.low


class Steps:
    """Counts :func:`~gradbalance.balancers._solvers._fair_step` calls, and whether a step's
    residual fell to ``0.5`` or below (``dipped``: :class:`~._solvers._Stall` then keeps going,
    as a solve that converges would, up to ``max_iter``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self.dipped = False
        step = _solvers._fair_step

        def counted(*args: Any) -> Any:
            self.count += 1
            moved = step(*args)
            self.dipped |= moved is not None and moved[1][1] <= 0.5
            return moved

        monkeypatch.setattr(_solvers, "_fair_step", counted)

    def bound(self, early: int) -> int:
        """``early`` steps where no residual dipped, else the solves' cap (100 each)."""
        return early if not self.dipped else early + 100


@pytest.mark.parametrize("low", [False, True])
@settings(max_examples=25, deadline=None)
@given(st.integers(3, 64), st.integers(1, 8), st.integers(0, 3), st.integers(0, 2**16))
def test_no_solution_stops_early_raises_and_moves_nothing(low: bool, k: int, rank: int,
                                                          zeros: int, seed: int) -> None:
    zeros = min(zeros, k - 3)
    g = planted_rows(k, min(rank, k - 2 - zeros), 0.0, zeros, seed)
    with pytest.MonkeyPatch.context() as mp:
        precision = Precision(mp, low)
        steps = Steps(mp)
        nash = NashMTL(no_solution="raise")
        before = copy.deepcopy(nash.state_dict())
        with pytest.raises(SolverError, match="no solution"):
            nash.combine(g)
        nash_steps, nash_bound, steps.count, steps.dipped = steps.count, steps.bound(40), 0, False
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)
            w = FairGrad().combine(g).weights
    precision.check()
    assert nash.num_tasks is None and nash.alpha is None and int(nash.step) == 0
    assert same(before, nash.state_dict())
    assert any("no exact solution exists" in str(c.message) for c in caught)
    assert bool(torch.isfinite(w).all()) and bool((w >= 0).all())
    # Where it diverges the iterate doubles along the vanishing combination: the cancellation
    # reaches float32 rounding (2⁻²³ …) within about 25 steps; then three stalled steps. A
    # residual that dipped to 0.5 (rank-1 rows, K = 8, seed 0) runs to the cap instead.
    assert nash_steps <= nash_bound and steps.count <= steps.bound(40), (nash_steps,
                                                                          steps.count)


@pytest.mark.parametrize("low", [False, True])
@settings(max_examples=25, deadline=None)
@given(st.integers(3, 32), st.integers(0, 2), st.sampled_from([1e-1, 1e-2]),
       st.integers(0, 2**16))
def test_near_cancelling_rows_with_a_solution_are_solved(low: bool, k: int, zeros: int,
                                                         eps: float, seed: int) -> None:
    """The planted combination lifted to ``ε`` of the rows' scale (``K − 1 − zeros ≤ 64``
    rows in general position: a solution exists): ``αᵢ (G α)ᵢ = 1`` on the non-zero rows,
    ``αᵢ = 0`` on the zero ones, although the combination nearly cancels."""
    zeros = min(zeros, k - 3)
    g = planted_rows(k, k - 1 - zeros, eps, zeros, seed)
    with pytest.MonkeyPatch.context() as mp:
        precision = Precision(mp, low)
        alpha = NashMTL().combine(g).weights
    precision.check()
    gram = g @ g.T
    live = torch.diagonal(gram) > 0
    torch.testing.assert_close((alpha * (gram @ alpha))[live],
                               torch.ones(int(live.sum()), dtype=F64), rtol=0, atol=1e-8)
    assert bool((alpha[~live] == 0).all())


@pytest.mark.parametrize("low", [False, True])
@settings(max_examples=25, deadline=None)
@given(st.integers(3, 64), st.integers(1, 8), st.integers(0, 3), st.integers(0, 2**16))
def test_no_solution_by_default_solves_the_ridge(low: bool, k: int, rank: int, zeros: int,
                                                 seed: int) -> None:
    """By default Nash-MTL warns and returns the solution of the ridge's equation
    ``αᵢ ((G + εD) α)ᵢ = 1`` on the non-zero rows (``ε = 1e-6 tr G``, ``D`` their indicator),
    checked on the float64 Gramian of the rows to the documented ``1e-6``, with ``α = 0`` on
    the zero rows; the update stays bounded, ``‖Jᵀα‖² = αᵀGα ≤`` the number of non-zero rows."""
    zeros = min(zeros, k - 3)
    g = planted_rows(k, min(rank, k - 2 - zeros), 0.0, zeros, seed)
    with pytest.MonkeyPatch.context() as mp:
        precision = Precision(mp, low)
        steps = Steps(mp)
        with pytest.warns(RuntimeWarning, match="has no solution"):
            result = NashMTL().combine(g)
    precision.check()
    alpha = result.weights
    assert alpha is not None and bool(torch.isfinite(result.vector).all())
    gram = g @ g.T
    live = torch.diagonal(gram) > 0
    ridged = gram + torch.diag(live.to(F64) * 1e-6 * float(gram.trace()))
    residual = (alpha * (ridged @ alpha) - 1.0)[live].abs().max()
    assert float(residual) <= 1e-6, float(residual)
    assert bool((alpha[~live] == 0).all()) and bool((alpha[live] > 0).all())
    assert float(result.vector.square().sum()) <= int(live.sum()) * (1 + 1e-9)
    # The failed solve stops early (as above), the ridge's converges: two short Newton runs
    # (the failed one to its cap where its residual dipped to 0.5).
    assert steps.count <= steps.bound(80), steps.count
