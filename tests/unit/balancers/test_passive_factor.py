"""The passive factors of the batched active set, updated per addition and removal, against
their definitions and a least-squares projection (K ≤ 40).

After a random sequence of additions (each index independent of the passive ones) and
removals (refactorised, or deleted by Givens rotations), every problem's stored ``C``, ``W``
and ``h`` must satisfy their definitions on its own passive set (``C Cᵀ = Q_PP``,
``C W = Q_P:``, ``C h = rhs_P``), the off-span distances must equal those of ``numpy``'s
least squares on the rows themselves (``Q = G Gᵀ / tr``: the squared residual of each row
against the passive ones, to ``eps κ(Q_PP)``: a Gramian fixes no more), and :meth:`solve`
and :meth:`try_add` must solve their systems (residuals recomputed in float64). Inputs: the
kinds of rows of the many-task check (``support.many_kinds``: rank-deficient, near
duplicates, wide norms, …).
The batched active set run in chunks (as at K = 1,024) against scipy's NNLS on the rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _active_set, _passive_factor
from gradbalance.balancers._active_set import SCHUR_RTOL_PER_ROW
from gradbalance.balancers._passive_factor import PassiveFactor
from gradbalance.balancers._solvers import trace_normalized
from support.balancers import nnls_dual_cone
from support.many_kinds import KIND_NAMES, assert_same_update, kind_rows

F64 = torch.float64
EPS = torch.finfo(F64).eps
CASES = st.tuples(st.integers(3, 40), st.sampled_from(KIND_NAMES), st.integers(0, 2**16))


@pytest.fixture(autouse=True, scope="module")
def _removals_by_size() -> Iterator[None]:
    """Removals refactorised or rotated by ``DOWNDATE_MIN_SIZE`` alone (the work rule off),
    so that each test here reaches the path it names on small problems."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_passive_factor, "REFACTOR_MAX_WORK", 0)
        yield


class _Seen:
    """The largest entries each problem's ``W`` (per column) and ``h`` held so far: a Givens
    rotation mixes two rows of them, so its rounding is ``eps`` of those rows' sizes, which
    before a deletion may be far above what is left after it (norms 1e-6 … 1e6)."""

    def __init__(self, f: PassiveFactor) -> None:
        self.w = torch.zeros(f.off.shape, dtype=F64)
        self.h = torch.zeros(f.off.shape[0], dtype=F64)
        self.record(f)

    def record(self, f: PassiveFactor) -> None:
        if f.w.shape[1]:
            self.w = torch.maximum(self.w, f.w[f.slot].abs().amax(dim=1))
            self.h = torch.maximum(self.h, f.h.abs().amax(dim=1))


def _run(q: Tensor, rhs: Tensor, gen: torch.Generator, steps: int,
         factor: Tensor) -> tuple[PassiveFactor, _Seen]:
    """Random additions of independent indices, and every third step a random removal."""
    f = PassiveFactor(q, rhs)
    seen = _Seen(f)
    b, k = rhs.shape
    passive = torch.zeros(b, k, dtype=torch.bool)
    rows = torch.arange(b)
    min_schur = SCHUR_RTOL_PER_ROW * k * q.diagonal()
    for step in range(steps):
        score = torch.rand(b, k, generator=gen, dtype=F64)
        indep = ~passive & (f.off > 100 * min_schur)
        if step % 3 == 2 and bool(passive.any(dim=1).all()):
            drop = torch.where(passive, score, -1.0).argmax(dim=1)
            passive[rows, drop] = False
            f.remove(rows, passive.clone())
            continue
        if not bool(indep.any(dim=1).all()):
            break
        t = torch.where(indep, score, -1.0).argmax(dim=1)
        z, root, h_t = f.try_add(t, min_schur[t])
        assert bool(torch.isfinite(z).all())
        full = passive.clone()
        full[rows, t] = True
        _assert_solves(q, rhs, full, z, seen.h)
        f.add(rows, t, root, h_t)
        seen.record(f)
        passive = full
    _assert_solves(q, rhs, passive, f.solve(rows), seen.h)
    _assert_factors(q, rhs, f, passive, factor, seen)
    return f, seen


def _assert_solves(q: Tensor, rhs: Tensor, passive: Tensor, z: Tensor,
                   seen_h: Tensor | None = None) -> None:
    """``z`` zero off ``P`` and ``Q_PP z_P = rhs_P`` relative to ``|Q_PP||z_P| + |rhs_P|``
    plus, after rotations, what an error of ``eps`` of the largest ``h`` seen (``seen_h``)
    makes of the residual: ``C δh``, at most ``(|C| 1)ᵢ`` = ``√(m Qᵢᵢ)`` times it."""
    assert bool((z[~passive] == 0).all())
    for i in range(rhs.shape[0]):
        p = torch.nonzero(passive[i]).flatten()
        res = q[p][:, p] @ z[i, p] - rhs[i, p]
        scale = q[p][:, p].abs() @ z[i, p].abs() + rhs[i, p].abs() + 1e-300
        if seen_h is not None:
            scale = scale + (p.numel() * q.diagonal()[p]).sqrt() * seen_h[i]
        assert float((res.abs() / scale).max()) <= 1e-7


def _assert_product(a: Tensor, b: Tensor, target: Tensor, seen: Tensor | None = None) -> None:
    """``A B = target`` relative to ``‖Aᵢ‖₁ max|B_:ⱼ|`` (normwise, to 1e-9), ``max|B_:ⱼ|``
    the largest entries of that column seen (``seen``: the rotations mix the rows of ``B``)."""
    big = b.abs().amax(dim=0, keepdim=True)
    if seen is not None:
        big = torch.maximum(big, seen[None])
    scale = a.abs().sum(dim=1, keepdim=True) * big + 1e-300
    assert float(((a @ b - target).abs() / scale).max()) <= 1e-9


def _assert_factors(q: Tensor, rhs: Tensor, f: PassiveFactor, passive: Tensor,
                    factor: Tensor, seen: _Seen) -> None:
    """The definitions on each passive set; ``factor`` ``[K, P]`` the rows, ``Q = FFᵀ``;
    ``seen`` the largest entries of ``W`` and ``h`` so far."""
    import numpy as np

    rows_np = factor.numpy()
    for i in range(rhs.shape[0]):
        m = int(f.count[i])
        order = f.order[i, :m]
        assert sorted(order.tolist()) == torch.nonzero(passive[i]).flatten().tolist()
        c, w, h = f.chol[i, :m, :m], f.w[i, :m], f.h[i, :m]
        _assert_product(c, c.T, q[order][:, order])
        _assert_product(c, w, q[order], seen.w[i])
        _assert_product(c, h[:, None], rhs[i, order][:, None], seen.h[i, None])
        assert bool((f.w[i, m:] == 0).all()) and bool((f.h[i, m:] == 0).all())
        basis = rows_np[order.numpy()].T  # [P, m]: the passive rows
        coef = np.linalg.lstsq(basis, rows_np.T, rcond=None)[0]
        off = ((rows_np.T - basis @ coef) ** 2).sum(axis=0)
        # a Gramian fixes sⱼ to about eps κ(Q_PP) Qⱼⱼ (near-duplicate passive rows)
        bound = 64 * np.finfo(float).eps * np.linalg.cond(q[order][:, order].numpy()) + 1e-12
        assert np.allclose(f.off[i].numpy(), off, rtol=1e-6, atol=bound * float(q.max()))


@settings(max_examples=30, deadline=None)
@given(CASES, st.booleans())
def test_updated_factors_match_their_definitions(case: tuple[int, str, int],
                                                 rotate: bool) -> None:
    """Removals by Givens rotations (``rotate``: ``DOWNDATE_MIN_SIZE`` 0) or refactorised."""
    k, kind, seed = case
    g = kind_rows(kind, k, 2 * k + 3, seed)
    g = g[g.norm(dim=1) > 0]
    if g.shape[0] < 2:
        return
    q, trace = trace_normalized(g @ g.T)
    gen = torch.Generator().manual_seed(seed)
    rhs = torch.randn(4, g.shape[0], generator=gen, dtype=F64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_passive_factor, "DOWNDATE_MIN_SIZE", 0 if rotate else 10**9)
        _run(q, rhs, gen, min(12, g.shape[0]), g / trace.sqrt())


@settings(max_examples=4, deadline=None)
@given(st.integers(17, 32), st.sampled_from(["rank8", "mixed", "near_duplicates"]),
       st.integers(0, 2**16))
def test_active_set_in_chunks_matches_scipy(k: int, kind: str, seed: int) -> None:
    """Problems solved in chunks of 8 (``FACTOR_MAX_ENTRIES`` lowered): every projection the
    update of scipy's NNLS on the rows (cosine ≥ 0.999999, norm within 1e-6 relative)."""
    g = kind_rows(kind, k, 2 * k + 3, seed)
    g = g[g.norm(dim=1) > 0]
    gram, trace = trace_normalized(g @ g.T)
    u = torch.diag(torch.rand(g.shape[0], generator=torch.Generator().manual_seed(seed),
                              dtype=F64))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_active_set, "FACTOR_MAX_ENTRIES", 8 * g.shape[0] ** 2)
        v, done = _active_set.box_active_set(gram, u, 1e-12, 3 * g.shape[0] + 10)
    assert bool(done.all()) and bool((v >= u).all())
    for i in sorted({0, g.shape[0] // 2, g.shape[0] - 1}):
        assert_same_update(v[i] @ g, nnls_dual_cone(g / trace.sqrt(), u[i]) * trace.sqrt(), g)


@settings(max_examples=12, deadline=None)
@given(CASES, st.integers(2, 5))
def test_block_additions_match_their_definitions(case: tuple[int, str, int], width: int) -> None:
    """``b`` indices entering together (:meth:`try_block`, the first ``size`` of each kept):
    the factors' definitions, and each prefix's solve, as after single additions."""
    k, kind, seed = case
    g = kind_rows(kind, k, 2 * k + 3, seed)
    g = g[g.norm(dim=1) > 0]
    if g.shape[0] < width + 1:
        return
    q, trace = trace_normalized(g @ g.T)
    gen = torch.Generator().manual_seed(seed)
    rhs = torch.randn(4, g.shape[0], generator=gen, dtype=F64)
    f, seen = _run(q, rhs, gen, min(4, g.shape[0] - width), g / trace.sqrt())
    rows = torch.arange(4)
    passive = torch.zeros(4, g.shape[0], dtype=torch.bool)
    for i in range(4):
        passive[i, f.order[i, : int(f.count[i])]] = True
    for _ in range(2):  # the second round from passive sets of different sizes
        if int((~passive).sum(dim=1).min()) < width:
            break
        passive = _add_blocks(q, rhs, f, passive, gen, width)
        seen.record(f)
    _assert_solves(q, rhs, passive, f.solve(rows), seen.h)
    _assert_factors(q, rhs, f, passive, g / trace.sqrt(), seen)


def _add_blocks(q: Tensor, rhs: Tensor, f: PassiveFactor, passive: Tensor,
                gen: torch.Generator, width: int) -> Tensor:
    """Random blocks of ``width`` entering every problem, a random prefix of each kept (at
    most its independent one): each prefix's solve checked; the passive sets after."""
    b, k = passive.shape
    rows = torch.arange(b)
    score = torch.rand(b, k, generator=gen, dtype=F64)
    t = torch.where(passive, -1.0, score).topk(width, dim=1).indices
    z, ok, block = f.try_block(rows, t, SCHUR_RTOL_PER_ROW * k * q.diagonal()[t])
    for j in range(width):
        sub = ok[:, j]
        full = passive.clone()
        full[rows[:, None], t[:, : j + 1]] = True
        _assert_solves(q, rhs[sub], full[sub], z[sub, j])
    most = torch.where(ok, torch.arange(width) + 1, 0).amax(dim=1)
    size = torch.minimum(torch.randint(0, width + 1, (b,), generator=gen), most)
    f.add_block(rows, size, block)
    out = passive.clone()
    for i in range(b):
        out[i, t[i, : int(size[i])]] = True
    return out


@settings(max_examples=5, deadline=None)
@given(st.integers(12, 40), st.sampled_from(KIND_NAMES), st.integers(0, 2**16))
def test_active_set_with_blocks_matches_scipy(k: int, kind: str, seed: int) -> None:
    """Blocks of 3 candidates from any size (``BLOCK_MIN_SIZE`` 0): every third projection
    the update of scipy's NNLS on the rows (cosine ≥ 0.999999, norm within 1e-6 relative)."""
    g = kind_rows(kind, k, 2 * k + 3, seed)
    g = g[g.norm(dim=1) > 0]
    if g.shape[0] < 4:
        return
    gram, trace = trace_normalized(g @ g.T)
    u = torch.diag(torch.rand(g.shape[0], generator=torch.Generator().manual_seed(seed),
                              dtype=F64))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_active_set, "BLOCK_MIN_SIZE", 0)
        mp.setattr(_active_set, "BLOCK_SIZE", 3)
        v, done = _active_set.box_active_set(gram, u, 1e-12, 3 * g.shape[0] + 10)
    assert bool(done.all()) and bool((v >= u).all())
    for i in range(0, g.shape[0], 3):
        assert_same_update(v[i] @ g, nnls_dual_cone(g / trace.sqrt(), u[i]) * trace.sqrt(), g)


def _counted_blocks(taken: list[int]) -> Callable[..., Tensor]:
    """``_active_set._add_block``, appending to ``taken`` how many problems took a block."""
    real = _active_set._add_block

    def counted(st_: object, cand: Tensor, valid: Tensor, indep_min: Tensor) -> Tensor:
        rest = real(st_, cand, valid, indep_min)  # type: ignore[arg-type]
        taken.append(int((~rest).sum()))
        return rest
    return counted


@settings(max_examples=10, deadline=None)
@given(st.integers(12, 40), st.sampled_from(KIND_NAMES), st.integers(0, 2**16))
def test_one_problem_with_blocks_matches_scipy(k: int, kind: str, seed: int) -> None:
    """One problem (DualProj's, CAGrad's projection) also takes blocks of candidates (3 here,
    from any size): the projection of the mean is scipy NNLS's (cosine ≥ 0.999999, norm
    within 1e-6 relative), blocks counted where more than one index entered at once."""
    g = kind_rows(kind, k, 2 * k + 3, seed)
    g = g[g.norm(dim=1) > 0]
    if g.shape[0] < 4:
        return
    gram, trace = trace_normalized(g @ g.T)
    mean = torch.full((1, g.shape[0]), 1.0 / g.shape[0], dtype=F64)
    taken: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_active_set, "BLOCK_MIN_SIZE", 0)
        mp.setattr(_active_set, "BLOCK_SIZE", 3)
        mp.setattr(_active_set, "_add_block", _counted_blocks(taken))
        v, done = _active_set.box_active_set(gram, mean, 1e-12, 3 * g.shape[0] + 10)
    assert bool(done.all()) and bool((v >= mean).all())
    assert taken or torch.equal(v, mean)  # the block path ran wherever an index entered
    assert_same_update(v[0] @ g, nnls_dual_cone(g / trace.sqrt(), mean[0]) * trace.sqrt(), g)


@settings(max_examples=20, deadline=None)
@given(st.integers(17, 48), st.integers(1, 6), st.integers(0, 2**16), st.booleans())
def test_free_blocks_are_the_principal_submatrices(k: int, b: int, seed: int,
                                                   per_problem: bool) -> None:
    """Each free set's block gathered either way (one flat index, or rows then columns per
    problem) is ``A[F, F]`` indexed directly (``A`` not symmetric), the identity on the
    padding; and
    ``solve_free`` solves ``Q_FF y_F = rhs_F`` (residual at the rounding of ``κ(Q_FF)``)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, k + 5, generator=gen, dtype=F64)
    q = g @ g.T
    free = torch.rand(b, k, generator=gen) < 0.6
    free[:, 0] = True
    rhs = torch.randn(b, k, generator=gen, dtype=F64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_active_set, "PER_PROBLEM_MIN_SIZE", 1 if per_problem else 10**9)
        idx, valid = _active_set.free_first(free)
        blocks = _active_set.free_blocks(g[:, :k], idx, valid)  # not symmetric: order shows
        y = _active_set.solve_free(q, rhs, free, None)
    for i in range(b):
        f = torch.nonzero(free[i]).flatten()
        n = f.numel()
        torch.testing.assert_close(blocks[i, :n, :n], g[f][:, f], rtol=0, atol=0)
        pad = blocks[i, n:, n:]
        torch.testing.assert_close(pad, torch.eye(pad.shape[0], dtype=F64), rtol=0, atol=0)
        assert not bool(blocks[i, :n, n:].any())
        sub = q[f][:, f]
        residual = float((sub @ y[i, f] - rhs[i, f]).norm())
        cond = float(torch.linalg.cond(sub))
        assert residual <= 1e3 * EPS * cond * float(rhs[i, f].norm())
        assert not bool(y[i][~free[i]].any())


@pytest.mark.parametrize("seed", [0, 1])
def test_cagrads_projection_takes_blocks_at_many_tasks(seed: int) -> None:
    """CAGrad's one projection (a zero row, a third of the tasks mildly opposed, K = 96, the
    library's own block sizes): blocks of indices enter, and the update is the conflict-free
    one closest to ``g₀`` (scipy's NNLS projection)."""
    from gradbalance.balancers import CAGrad
    from support.balancers import check_cagrad_zero_optimum

    k, p = 96, 400
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(p, generator=gen, dtype=F64)
    g = (1 + 0.3 * torch.randn(k, 1, generator=gen, dtype=F64)) * shared + 0.2 * torch.randn(
        k, p, generator=gen, dtype=F64)
    g[::3] = -0.01 * shared + torch.randn(len(g[::3]), p, generator=gen, dtype=F64)
    g[1] = 0
    taken: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_active_set, "_add_block", _counted_blocks(taken))
        d = CAGrad(c=0.4)(g)
    assert sum(taken) > 0
    assert check_cagrad_zero_optimum(g, d, 1e-9)
