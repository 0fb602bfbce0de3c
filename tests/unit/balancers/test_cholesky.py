"""The blocked Cholesky factorisation (``balancers/_cholesky.py``) against the definition
``LLᵀ = A`` with Higham's backward-error bound (*Accuracy and Stability of Numerical
Algorithms*, 2nd ed., Thm. 10.3: ``‖LLᵀ − A‖ ≤ c·n·u·‖A‖``), the uniqueness of the factor
with a positive diagonal (so ``torch``'s own ``potrf`` is a second implementation of the
same matrix), and ``info`` as LAPACK defines it: the order of the first leading minor that
is not positive definite."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _cholesky
from gradbalance.balancers._cholesky import cholesky_ex, principal_block

F64 = torch.float64
EPS = torch.finfo(F64).eps


def _spd(n: int, seed: int, cond: float, dtype: torch.dtype = F64) -> Tensor:
    """A symmetric positive definite ``[n, n]`` with eigenvalues ``logspace(0, -log10 cond)``
    in a random orthogonal basis."""
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    eig = torch.logspace(0, -float(torch.log10(torch.tensor(cond))), n, dtype=F64)
    a = (basis * eig) @ basis.T
    return ((a + a.T) / 2).to(dtype)


@settings(max_examples=6, deadline=None)
@given(n=st.integers(_cholesky.BLOCKED_MIN_SIZE, _cholesky.BLOCKED_MIN_SIZE + 200),
       seed=st.integers(0, 2**16), log_cond=st.floats(0.0, 8.0))
def test_blocked_factor_reproduces_the_matrix(n: int, seed: int, log_cond: float) -> None:
    """Every order from the blocked threshold on, sizes not a multiple of the block: a lower
    factor with a positive diagonal whose ``LLᵀ`` is ``A`` to ``n·u·‖A‖``, equal to
    ``potrf``'s factor to the factor's own conditioning."""
    cond = 10.0**log_cond
    a = _spd(n, seed, cond)
    before = a.clone()
    low, info = cholesky_ex(a)
    assert int(info) == 0
    assert torch.equal(a, before)  # the input is read, not written
    assert torch.equal(low, low.tril())
    assert bool((low.diagonal() > 0).all())
    scale = float(torch.linalg.matrix_norm(a, 2))
    assert float(torch.linalg.matrix_norm(low @ low.T - a, 2)) <= 4 * n * EPS * scale
    reference = torch.linalg.cholesky(a)
    gap = float((low - reference).abs().max()) / float(reference.abs().max())
    assert gap <= 4 * n * EPS * cond ** 0.5


@settings(max_examples=6, deadline=None)
@given(n=st.integers(_cholesky.BLOCKED_MIN_SIZE, _cholesky.BLOCKED_MIN_SIZE + 300),
       seed=st.integers(0, 2**16), data=st.data())
def test_first_failing_minor_is_reported(n: int, seed: int, data: st.DataObject) -> None:
    """A negative diagonal entry at ``j`` (the leading minors before it untouched, the one
    of order ``j + 1`` indefinite): ``info = j + 1``, in the first block, at a block's edge
    or in the last one."""
    j = data.draw(st.sampled_from([0, _cholesky.BLOCK - 1, _cholesky.BLOCK, n - 1])
                  | st.integers(0, n - 1))
    a = _spd(n, seed, 10.0)
    a[j, j] = -1.0
    assert int(cholesky_ex(a).info) == j + 1 == int(torch.linalg.cholesky_ex(a).info)


def test_float32_and_small_and_batched_inputs() -> None:
    """float32 at a blocked order to float32's rounding; below the threshold and batched the
    call is ``torch``'s own, bit for bit."""
    n = _cholesky.BLOCKED_MIN_SIZE + 37
    a = _spd(n, 3, 100.0, torch.float32)
    low, info = cholesky_ex(a)
    assert int(info) == 0 and low.dtype == torch.float32
    err = float(torch.linalg.matrix_norm((low @ low.T - a).double(), 2))
    assert err <= 4 * n * torch.finfo(torch.float32).eps * float(torch.linalg.matrix_norm(
        a.double(), 2))
    small = _spd(40, 4, 10.0)
    assert torch.equal(cholesky_ex(small).L, torch.linalg.cholesky_ex(small).L)
    batch = torch.stack([_spd(_cholesky.BLOCKED_MIN_SIZE, s, 10.0) for s in (5, 6)])
    assert torch.equal(cholesky_ex(batch).L, torch.linalg.cholesky_ex(batch).L)


def test_every_solver_factorises_through_the_one_place() -> None:
    """docs/ARCHITECTURE.md: ``_cholesky.cholesky_ex`` is the one Cholesky factorisation the
    package calls; no other module calls ``torch``'s (``cholesky_ex`` or ``cholesky``)
    directly, so no large order escapes the blocked path."""
    from pathlib import Path

    import gradbalance

    root = Path(gradbalance.__file__).parent
    direct = sorted(str(path.relative_to(root)) for path in root.rglob("*.py")
                    if path.name != "_cholesky.py"
                    and ("linalg.cholesky_ex(" in path.read_text()
                         or "linalg.cholesky(" in path.read_text()
                         or "torch.cholesky_solve(" in path.read_text()))
    assert direct == []


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 700), batch=st.integers(0, 3), width=st.integers(1, 3),
       seed=st.integers(0, 2**16), log_cond=st.floats(0.0, 6.0))
def test_cholesky_solve_solves_the_system(n: int, batch: int, width: int, seed: int,
                                          log_cond: float) -> None:
    """``cholesky_solve(b, L)`` solves ``A x = b`` for ``A = LLᵀ``: its residual is within
    the backward-stable bound ``c·n·u·‖A‖‖x‖`` (Higham, Thm. 10.4), single and batched."""
    shape = (batch,) if batch else ()
    a = torch.stack([_spd(n, seed + i, 10.0**log_cond) for i in range(max(batch, 1))])
    a = a.reshape(*shape, n, n)
    b = torch.randn(*shape, n, width, generator=torch.Generator().manual_seed(seed), dtype=F64)
    low, info = cholesky_ex(a) if a.ndim == 2 else torch.linalg.cholesky_ex(a)
    assert int(info.max()) == 0
    x = _cholesky.cholesky_solve(b, low)
    residual = torch.linalg.matrix_norm(a @ x - b, ord=2) if a.ndim > 2 else (a @ x - b).norm()
    scale = torch.linalg.matrix_norm(a, ord=2) * torch.linalg.matrix_norm(x, ord=2)
    assert bool((residual <= 8 * n * EPS * scale).all())


@settings(max_examples=30, deadline=None)
@given(n=st.integers(3, 40), seed=st.integers(0, 2**16), data=st.data())
def test_block_factors_are_the_blocks_own_and_kept(n: int, seed: int,
                                                   data: st.DataObject) -> None:
    """``BlockFactors.factor(F)`` is the factor of the principal block ``A_FF`` (``torch``'s
    ``potrf`` of the block gathered by hand: the factor with a positive diagonal is unique),
    the same object while the block is among the ``KEPT_BLOCKS`` most recently used, and a
    fresh factorisation (equal again) once it has been pushed out."""
    a = _spd(n, seed, 1e4)
    blocks = _cholesky.BlockFactors(a)
    sets = [sorted(data.draw(st.sets(st.integers(0, n - 1), min_size=1), label=f"F{i}"))
            for i in range(_cholesky.KEPT_BLOCKS + 1)]
    sets = [list(s) for s in dict.fromkeys(tuple(s) for s in sets)]  # distinct sets
    first = blocks.factor(sets[0])
    for idx in sets:
        got = blocks.factor(idx)
        sel = torch.tensor(idx)
        own = torch.linalg.cholesky(a[sel][:, sel])
        assert int(got.info) == 0
        assert torch.allclose(got.L, own, rtol=0.0, atol=64 * EPS * float(a.abs().max()))
        assert blocks.factor(idx) is got  # kept: the same factor, no second factorisation
    whole = blocks.factor(list(range(n)))
    assert torch.allclose(whole.L @ whole.L.T, a, rtol=0.0, atol=64 * n * EPS)
    others = {tuple(s) for s in sets[1:]} | {tuple(range(n))}  # used after sets[0]
    pushed_out = len(others - {tuple(sets[0])}) >= _cholesky.KEPT_BLOCKS
    assert (blocks.factor(sets[0]) is first) != pushed_out


def test_block_factors_report_a_block_that_is_not_positive_definite() -> None:
    """``info`` is the order of the first failing leading minor of the block, as LAPACK's."""
    a = torch.tensor([[1.0, 2.0, 0.0], [2.0, 1.0, 0.0], [0.0, 0.0, 1.0]], dtype=F64)
    blocks = _cholesky.BlockFactors(a)
    assert int(blocks.factor([0, 1]).info) == 2
    assert int(blocks.factor([0, 2]).info) == 0


@pytest.mark.parametrize("seed", range(3))
def test_single_problem_with_kept_factors_and_its_fallback(seed: int) -> None:
    """``_boxqp.solve_single_kept`` (CAGrad's QPs): with ``BlockFactors``' factors it is the
    simplex QP's minimiser (KKT: ``x ≥ 0``, ``Σx = 1``, the gradient ``Qx + c`` equal on the
    support and not smaller off it); where the kept factors report a failure, its least
    squares on a factor of ``Q`` give the same minimiser."""
    from gradbalance.balancers import _boxqp

    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(12, 30, generator=gen, dtype=F64)
    q = rows @ rows.T
    c = torch.randn(12, generator=gen, dtype=F64)
    lower = torch.zeros(12, dtype=F64)
    blocks = _cholesky.BlockFactors(q)

    def failing(idx: list[int]) -> _cholesky.Factor:
        low, _ = blocks.factor(idx)
        return _cholesky.Factor(low, torch.tensor(1, dtype=torch.int32))

    for factor_of in (blocks.factor, failing):
        x = _boxqp.solve_single_kept(q, c, lower, True, None, 1e-12, factor_of)
        grad = q @ x + c
        support = x > 1e-12
        nu = grad[support].mean()
        scale = float(grad.abs().max()) + 1.0
        assert bool((x >= 0).all()) and abs(float(x.sum()) - 1.0) < 1e-12
        assert float((grad[support] - nu).abs().max()) < 1e-9 * scale
        assert bool((grad[~support] >= nu - 1e-9 * scale).all())


@pytest.mark.parametrize(("k", "m"), [(5, 3), (100, 63), (100, 64), (300, 200)])
def test_principal_block_is_the_rows_and_columns_of_its_indices(k: int, m: int) -> None:
    # both sides of GATHER_MIN_SIZE (index_select below, torch.gather from it), into a new
    # tensor and into a view of a batch, as free_blocks writes them
    gen = torch.Generator().manual_seed(k + m)
    q = torch.randn(k, k, generator=gen, dtype=torch.float64)
    at = torch.sort(torch.randperm(k, generator=gen)[:m]).values
    expected = torch.stack([q[i, at] for i in at.tolist()])
    assert torch.equal(principal_block(q, at), expected)
    batch = q.new_zeros(2, m, m)
    principal_block(q, at, batch[1])
    assert torch.equal(batch[1], expected)
    assert not bool(batch[0].any())
