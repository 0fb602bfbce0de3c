"""The conditioning test of the conjugate-gradient pivoting without eigenvalues
(``certified_inverse``): against the eigenvalues (``torch.linalg.eigvalsh``, the test it
replaces from ``CG_MIN_SIZE`` tasks on) on matrices of known spectrum, condition numbers
1 … 1e13, singular and indefinite ones.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import _boxqp

F64 = torch.float64


def with_spectrum(eigenvalues: Tensor, seed: int) -> Tensor:
    """``U diag(λ) Uᵀ`` for a random orthogonal ``U``, trace-normalised when positive."""
    gen = torch.Generator().manual_seed(seed)
    k = eigenvalues.shape[0]
    u, _ = torch.linalg.qr(torch.randn(k, k, generator=gen, dtype=F64))
    q = (u * eigenvalues) @ u.T
    q = 0.5 * (q + q.T)
    trace = torch.trace(q)
    return q / trace if float(trace) > 0 else q


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 40), st.floats(0.0, 13.0), st.integers(0, 2**16))
def test_certified_only_below_the_limit_and_always_well_inside_it(k: int, log_cond: float,
                                                                  seed: int) -> None:
    """A returned inverse: the eigenvalues say well conditioned, and it is ``Q⁻¹``; none
    returned: the condition number is within ``K`` times the limit (the bound's slack) or
    above it."""
    gen = torch.Generator().manual_seed(seed)
    lam = torch.logspace(0.0, -log_cond, k, dtype=F64)[torch.randperm(k, generator=gen)]
    q = with_spectrum(lam, seed)
    well, definite = _boxqp._conditioning(q)
    cond = 10.0**log_cond
    h = _boxqp.certified_inverse(q)
    if h is not None:
        assert well and definite
        eye = torch.eye(k, dtype=F64)
        assert float(torch.linalg.matrix_norm(h @ q - eye)) <= 1e3 * cond * k * 2.2e-16
    else:
        assert cond * k > _boxqp.CHOLESKY_MAX_COND / 10


def test_singular_and_indefinite_matrices_get_none() -> None:
    """Zero and negative eigenvalues: no inverse (the eigenvalues decide)."""
    k = 12
    lam = torch.linspace(1.0, 2.0, k, dtype=F64)
    for low in (0.0, -1e-3, -1.0):
        lam[0] = low
        q = with_spectrum(lam, 3)
        assert _boxqp.certified_inverse(q) is None
        assert not _boxqp._conditioning(q)[0]


@settings(max_examples=12, deadline=None)
@given(st.integers(64, 96), st.floats(0.0, 13.0), st.integers(0, 2**16))
def test_is_well_conditioned_from_the_cholesky_agrees_with_the_eigenvalues(
        k: int, log_cond: float, seed: int) -> None:
    """From ``CG_MIN_SIZE`` tasks on ``is_well_conditioned`` decides by one Cholesky
    factorisation where its bounds do: the same answer as the eigenvalues' test on matrices
    of known spectrum (condition numbers 1 … 1e13), away from the limit by the spectrum's
    own rounding (a factor 2)."""
    assert k >= _boxqp.CG_MIN_SIZE
    gen = torch.Generator().manual_seed(seed)
    lam = torch.logspace(0.0, -log_cond, k, dtype=F64)[torch.randperm(k, generator=gen)]
    q = with_spectrum(lam, seed)
    cond = 10.0**log_cond
    if 0.5 < cond / _boxqp.CHOLESKY_MAX_COND < 2.0:
        return  # at the limit the eigenvalues' own rounding decides
    assert _boxqp.is_well_conditioned(q) == (cond < _boxqp.CHOLESKY_MAX_COND)
    assert _boxqp.is_well_conditioned(q) == _boxqp._conditioning(q)[0]


def test_is_well_conditioned_refuses_singular_and_indefinite_at_many_tasks() -> None:
    """K = 80: a zero or negative eigenvalue is not well conditioned (the Cholesky fails or
    its bounds leave it to the eigenvalues, which say no)."""
    k = 80
    lam = torch.linspace(1.0, 2.0, k, dtype=F64)
    for low in (0.0, -1e-3, -1.0, 1e-12):
        lam[0] = low
        assert not _boxqp.is_well_conditioned(with_spectrum(lam, 4))
