"""The least-squares solves of the box-QP module (``balancers/_boxqp.py``): ``least_squares``
and the interior point's correction ``_corrected``, against the pseudo-inverse's least-norm
solution (``torch.linalg.pinv``, an SVD: a second implementation), the same answer on every
call, whatever the memory held before. ``torch.linalg.lstsq``'s default CPU driver
``gelsy`` reads its column-pivot array uninitialised: on the rank-deficient matrix below it
returns rank 0 or 4 from call to call."""

from __future__ import annotations

import pytest
import torch

from gradbalance.balancers import _boxqp

F64 = torch.float64
EPS = torch.finfo(F64).eps


def _dirty() -> None:
    """Freed integer buffers of non-zero values, which a later allocation may reuse."""
    for n in (4, 5, 8, 64, 256):
        torch.full((n,), 7, dtype=torch.int64)
        torch.full((n,), 3, dtype=torch.int32)


def test_rank_deficient_least_squares_is_the_least_norm_solution_every_time() -> None:
    """``I₅`` with its first row zeroed, ``b = 1``: the least-norm solution is ``(0, 1, 1, 1,
    1)`` (``A⁺b``), on each of 50 calls after dirty allocations."""
    a = torch.eye(5, dtype=F64)
    a[0] = 0.0
    b = torch.ones(5, 1, dtype=F64)
    expected = torch.linalg.pinv(a) @ b
    assert torch.equal(expected[:, 0], torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0], dtype=F64))
    for _ in range(50):
        _dirty()
        got = _boxqp.least_squares(a, b)
        assert torch.allclose(got, expected, rtol=0.0, atol=8 * EPS)


@pytest.mark.parametrize(("m", "n", "rank", "seed"), [(20, 40, 20, 0), (30, 60, 18, 1),
                                                       (60, 30, 12, 2), (145, 256, 144, 3)])
def test_least_squares_matches_the_pseudo_inverse_and_repeats(m: int, n: int, rank: int,
                                                              seed: int) -> None:
    """Wide, tall and rank-deficient: ``A⁺B`` within ``64 κ² ε`` of its largest entry (``κ``
    the ratio of the largest to the ``rank``-th singular value: the least-squares
    perturbation bound with a residual, Golub & Van Loan Thm. 5.3.1), and bit for bit the
    same on a second call after dirty allocations."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, rank, generator=gen, dtype=F64) @ torch.randn(rank, n, generator=gen,
                                                                     dtype=F64)
    b = torch.randn(m, 2, generator=gen, dtype=F64)
    got = _boxqp.least_squares(a, b)
    expected = torch.linalg.pinv(a) @ b
    sv = torch.linalg.svdvals(a)
    kappa = float(sv[0] / sv[rank - 1])
    assert torch.allclose(got, expected, rtol=0.0,
                          atol=64 * EPS * kappa**2 * float(expected.abs().max()))
    _dirty()
    assert torch.equal(_boxqp.least_squares(a, b), got)


@pytest.mark.parametrize("seed", range(4))
def test_interior_correction_is_the_least_norm_step(seed: int) -> None:
    """``_corrected(A, b, x) = x + A⁺(b − Ax)`` for a wide ``A`` of full row rank (the
    normal equations' Cholesky path) and of a deficient one (``AAᵀ`` singular: the SVD
    path); ``None`` for a tall ``A``."""
    gen = torch.Generator().manual_seed(seed)
    for rank in (30, 20):
        a = torch.randn(30, rank, generator=gen, dtype=F64) @ torch.randn(rank, 70,
                                                                           generator=gen,
                                                                           dtype=F64)
        b = torch.randn(30, generator=gen, dtype=F64)
        x = torch.rand(70, generator=gen, dtype=F64)
        got = _boxqp._corrected(a, b, x)
        assert got is not None
        expected = x + torch.linalg.pinv(a) @ (b - a @ x)
        assert torch.allclose(got, expected, rtol=0.0, atol=1e-9 * float(expected.abs().max()))
    assert _boxqp._corrected(torch.randn(5, 3, dtype=F64), torch.randn(5, dtype=F64),
                             torch.rand(3, dtype=F64)) is None


def test_no_module_calls_lstsq_directly() -> None:
    """docs/ARCHITECTURE.md: ``_boxqp.least_squares`` is the one least-squares solve; no
    other place calls ``torch.linalg.lstsq`` (whose CPU default ``gelsy`` is not
    deterministic)."""
    from pathlib import Path

    import gradbalance

    root = Path(gradbalance.__file__).parent
    calls = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if "linalg.lstsq(" in p.read_text())
    assert calls == ["balancers/_boxqp.py"]
    assert (root / "balancers/_boxqp.py").read_text().count("linalg.lstsq(") == 1
