"""The accelerated projected-gradient start of the box pivoting (``_projected.py``): FISTA's
point against scipy's NNLS on the same problem, and UPGrad's update with and without the
start (the pivoting decides either way)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance.balancers import _boxqp, _projected
from gradbalance.balancers._solvers import trace_normalized
from gradbalance.balancers._upgrad import upgrad_weights
from support.many_kinds import assert_same_update

F64 = torch.float64


@settings(max_examples=12, deadline=None)
@given(st.integers(3, 40), st.integers(0, 2**16))
def test_fista_reaches_the_nnls_solution(k: int, seed: int) -> None:
    """``min ½ yᵀQy + shiftᵀy``, ``y ≥ 0`` with ``Q = JJᵀ`` of random rows (``P = 4K``: a
    condition number below 10): after 300 steps ``y`` is scipy's NNLS solution of
    ``min ‖Jᵀ(y + l)‖``, ``y ≥ 0`` (``shift = Q l``), ``free`` where it is positive and
    ``yq = yQ``."""
    gen = torch.Generator().manual_seed(seed)
    j = torch.randn(k, 4 * k, generator=gen, dtype=F64)
    q = j @ j.T
    lower = torch.randn(3, k, generator=gen, dtype=F64)
    shift = lower @ q
    top = float(torch.linalg.eigvalsh(q)[-1])
    free, y, yq = _projected.projected_start(q, shift, top, steps=300)
    from scipy.optimize import nnls

    for i in range(3):
        ref, _ = nnls(j.T.numpy(), -(j.T @ lower[i]).numpy(), maxiter=10_000)
        ref_t = torch.from_numpy(ref)
        assert torch.allclose(y[i], ref_t, atol=1e-7 * (float(ref_t.abs().max()) + 1.0))
    assert torch.allclose(yq, y @ q)
    assert torch.equal(free, y > 0)


@pytest.mark.parametrize(("k", "seed", "shared"), [(64, 0, 0.0), (96, 1, 0.0), (80, 2, 0.3),
                                                    (72, 3, 2.0)])
def test_upgrad_is_the_same_with_and_without_the_start(k: int, seed: int, shared: float) -> None:
    """UPGrad's update (K ≥ 64: the conjugate-gradient pivoting) with the projected start
    forced on every Gramian, with it forced off, and as chosen: the same update, on rows
    with no shared direction (the start's case) and with one (a start far from the
    optimum: the pivoting still reaches it)."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, 4 * k, generator=gen, dtype=F64)
    g = g + shared * torch.randn(k, 1, generator=gen, dtype=F64) * torch.randn(
        4 * k, generator=gen, dtype=F64)
    gram = g @ g.T
    chosen = upgrad_weights(gram) @ g
    for forced in (True, False):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_projected, "PROJECTED_MAX_KAPPA", 1e30 if forced else 0.0)
            assert_same_update(upgrad_weights(gram) @ g, chosen, g)
    q, _ = trace_normalized(gram)
    assert q.shape[0] >= _boxqp.CG_MIN_SIZE
