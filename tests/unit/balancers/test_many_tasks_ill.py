"""UPGrad's and DualProj's projections on singular and badly conditioned Gramians, K ≤ 64.

The batched active set (every projection's Lawson–Hanson steps at once, singular Gramians)
and the pivoting with the relative multiplier test (positive definite, condition number
above 1e10, as per-sample Gramians) against two slow exact references: the per-problem
least squares on a factor of the Gramian (``_boxqp._solve_factored``) and scipy's NNLS on
the rows. Inputs: the adversarial kinds of ``test_many_tasks.py`` (rank-deficient, near
duplicates, norms spanning 1e-6 … 1e6, all three at once) and rows whose singular values
span 1 … 1e-6 (condition number 1e12), signed and scaled per row like per-sample gradients.
Tolerance: the same update (``test_many_tasks.assert_same_update``: cosine ≥ 0.999999 and
norm within 1e-6 relative, or both below ``1e-9 Σ‖gₖ‖``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import DualProj, UPGrad, _boxqp
from gradbalance.balancers._active_set import box_active_set
from gradbalance.balancers._solvers import trace_normalized
from support.balancers import nnls_dual_cone
from support.cone_reference import scipy_projection
from unit.balancers.test_many_tasks import KINDS, assert_same_update, rows

F64 = torch.float64


def ill_rows(k: int, p: int, seed: int, span: float = 1e-6) -> Tensor:
    """``[K, P]`` rows ``sₖ aₖ`` with ``A = U diag(σ) Vᵀ``, ``σ`` from 1 to ``span``
    (``G``'s condition number ``span⁻²``), ``sₖ`` random signs times ``logspace(-1, 1)``:
    a per-sample Gramian's shape (residual times feature gradient)."""
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(p, k, generator=gen, dtype=F64))
    a = u * torch.logspace(0, torch.log10(torch.tensor(span)).item(), k, dtype=F64) @ v.T
    signs = torch.randint(0, 2, (k, 1), generator=gen).to(F64) * 2 - 1
    return signs * torch.logspace(-1, 1, k, dtype=F64)[torch.randperm(k, generator=gen), None] * a


def reference(gram: Tensor, u: Tensor) -> Tensor:
    """The per-problem factored path: Lawson–Hanson on ``psd_factor(gram)``, one by one."""
    out = u.clone()
    done = torch.zeros(u.shape[0], dtype=torch.bool)
    return _boxqp._solve_factored(gram, torch.zeros_like(u), u, False, None, out, done, 1e-12)


CASES = st.tuples(st.integers(2, 64), st.sampled_from(KINDS), st.integers(0, 2**16))


def sample(k: int) -> list[int]:
    """Up to four projections spread over the K (the references solve one at a time)."""
    return sorted({0, k // 3, 2 * k // 3, k - 1})


@settings(max_examples=12, deadline=None)
@given(CASES)
def test_active_set_matches_the_factored_reference(case: tuple[int, str, int]) -> None:
    k, kind, seed = case
    g = rows(kind, k, 2 * k + 3, seed)
    gram, _ = trace_normalized(g @ g.T)
    u = torch.diag(torch.rand(k, generator=torch.Generator().manual_seed(seed), dtype=F64))
    v, done = box_active_set(gram, u, 1e-12, 3 * k + 10)
    assert bool(torch.isfinite(v).all()) and bool((v >= u).all())
    assert bool(done.all())
    picked = sample(k)
    slow = reference(gram, u[picked])
    for j, i in enumerate(picked):
        assert_same_update(v[i] @ g, slow[j] @ g, g)


@settings(max_examples=8, deadline=None)
@given(st.integers(17, 64), st.integers(0, 2**16), st.sampled_from([1e-5, 1e-6, 1e-7]))
def test_ill_conditioned_pivoting_matches_both_references(k: int, seed: int,
                                                          span: float) -> None:
    g = ill_rows(k, 3 * k, seed, span)
    gram, _ = trace_normalized(g @ g.T)
    well, definite = _boxqp._conditioning(gram)
    u = torch.eye(k, dtype=F64) / k
    fast = _boxqp.solve_box_qp_batched(gram, torch.zeros_like(u), u)
    picked = sample(k)
    slow = reference(gram, u[picked])
    scale = float(gram.trace() / (g * g).sum()) ** 0.5  # rows of J for the unit Gramian
    for j, i in enumerate(picked):
        assert_same_update(fast[i] @ g, slow[j] @ g, g)
        assert_same_update(fast[i] @ g, nnls_dual_cone(g * scale, u[i]) / scale, g)
    if span <= 1e-6:
        assert (well, definite) == (False, True)  # the relative-test pivoting ran


@pytest.mark.parametrize("kind", KINDS)
def test_dualproj_single_problem_matches_the_reference(kind: str) -> None:
    g = rows(kind, 48, 30, 3)
    gram, _ = trace_normalized(g @ g.T)
    p = torch.full((1, 48), 1 / 48, dtype=F64)
    fast = DualProj().combine(g).vector
    assert_same_update(fast, reference(gram, p)[0] @ g, g)


def test_upgrad_combine_on_an_ill_conditioned_gramian_is_conflict_free() -> None:
    g = ill_rows(64, 200, 5)
    out = UPGrad().combine(g).vector
    cos = (g @ out) / (g.norm(dim=1) * out.norm())
    assert float(cos.min()) >= -1e-9


@pytest.mark.parametrize(("k", "seed"), [(17, 73), (19, 0), (24, 3), (21, 11), (18, 7),
                                         (23, 5), (20, 1), (70, 2)])
def test_box_solver_on_an_unscaled_ill_gramian_reaches_the_projection(k: int, seed: int) -> None:
    """The box solver called on the trace-normalised Gramian of rows with norms spanning
    1e-6 … 1e6 (condition number about 1e24) solves on ``D⁻¹QD⁻¹`` itself
    (``_boxqp._diagonal_scale``), each problem scaled to a largest datum of 1: every
    projection's norm is scipy's NNLS projection's (independent), within 1e-6, and in the
    cone. Solved as given, (19, 0), (18, 7) and (23, 5) stayed 1e-5 … 4e-4 above it and
    outside the cone by 1e-3 of their size, and (19, 0) passed on two threads but not on one:
    the multipliers were tested against rounding of the Gramian's scale. In the cone to
    1e-9 of the bound's size with the factorisations, to ``CG_ERROR`` (the conjugate
    gradients' error bound, relative) from ``CG_MIN_SIZE`` tasks on."""
    inside = 1e-9 if k < _boxqp.CG_MIN_SIZE else _boxqp.CG_ERROR
    g = rows("wide_norms", k, 2 * k + 3, seed)
    gram, _ = trace_normalized(g @ g.T)
    u = torch.eye(k, dtype=F64) / k
    v = _boxqp.solve_box_qp_batched(gram, torch.zeros_like(u), u)
    norms = g.norm(dim=1)
    for i in range(k):
        x, ref = v[i] @ g, scipy_projection(g, u[i])
        assert float(x.norm()) <= float(ref.norm()) * (1 + 1e-6)
        assert float((g @ x / (norms * float(u[i] @ norms))).min()) >= -inside
