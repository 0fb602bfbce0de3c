"""IMTL-G on tasks given two or three times at norms decades apart (exact power-of-two
multiples: the cosine matrix is singular with ``1`` in its range, so ``Gv = d`` has
solutions and every one has equal projections). The pseudo-inverse of ``G`` itself cut the
short rows' directions (updates 45–3e4 times off at K = 8–20); the update now is ``G⁺d``'s.
Reference: ``G⁺d`` by mpmath's SVD at 80 digits on the exact Gramian of the rows."""

from __future__ import annotations

import mpmath as mp
import numpy as np
import pytest
import torch

from gradbalance.balancers import IMTLG
from gradbalance.balancers._denoise import cleaned
from gradbalance.gramian import compute_gramian, products_rounding


def _rows(k: int, seed: int, copies: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((k // copies, 40)).astype(np.float32).astype(np.float64)
    exps = rng.integers(-20, 21, k)  # norms over 2^±20 ≈ 1e±6, exact multiples
    return np.concatenate([base] * copies) * np.ldexp(1.0, exps)[:, None]


def _reference(rows: np.ndarray) -> np.ndarray:
    """``Jᵀw``, ``w = v/Σv``, ``v = G⁺d`` (singular values below ``1e-40`` of the largest
    cut: the exact zeros of the copies, ~1e-80 at this precision)."""
    with mp.workdps(80):
        j = mp.matrix(rows.tolist())
        g = j * j.T
        k = g.rows
        d = mp.matrix([mp.sqrt(g[i, i]) for i in range(k)])
        u, s, v = mp.svd_r(g)
        inverse = mp.matrix(k, k)
        for i in range(k):
            if s[i] > max(s) * mp.mpf(10) ** -40:
                inverse[i, i] = 1 / s[i]
        x = v.T * inverse * u.T * d
        w = x / sum(x)
        return np.array([float(t) for t in j.T * w])


@pytest.mark.parametrize(("k", "seed", "copies"), [
    (8, 0, 2), (12, 1, 2), (16, 2, 2), (20, 3, 2), (24, 4, 2), (9, 5, 3), (15, 6, 3),
    (24, 7, 3)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_copies_at_spread_norms_give_the_pseudo_inverse_update(
        k: int, seed: int, copies: int, dtype: torch.dtype) -> None:
    rows = _rows(k, seed, copies)
    expected = _reference(rows)
    got = IMTLG().combine(torch.tensor(rows, dtype=dtype)).vector.double().numpy()
    tol = 1e-6 if dtype == torch.float64 else 1e-5
    assert np.linalg.norm(got - expected) <= tol * np.linalg.norm(expected)
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    projections = unit @ got  # IMTL-G's property: equal projections on every task
    assert np.ptp(projections) <= 10 * tol * np.abs(projections).max()



def _uneven_rows(k: int, seed: int, copies: int) -> np.ndarray:
    """Copies at any norms: each row a float32 multiple ``c·2^e`` of its base, ``c`` in
    ``[1, 2)`` (exact multiples in float64; in a float32 product the copies' cosines equal
    only to its rounding)."""
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((k // copies, 40)).astype(np.float32).astype(np.float64)
    factors = rng.uniform(1.0, 2.0, k) * np.ldexp(1.0, rng.integers(-20, 21, k))
    return np.concatenate([base] * copies) * factors.astype(np.float32)[:, None]


@pytest.mark.parametrize(("k", "seed", "copies"), [
    (8, 10, 2), (16, 11, 2), (24, 12, 2), (15, 13, 3), (24, 14, 3), (48, 15, 2)])
def test_copies_at_any_norms_give_the_pseudo_inverse_update(k: int, seed: int,
                                                            copies: int) -> None:
    rows = _uneven_rows(k, seed, copies)
    expected = _reference(rows)
    got = IMTLG().combine(torch.tensor(rows)).vector.numpy()
    assert np.linalg.norm(got - expected) <= 1e-6 * np.linalg.norm(expected)


@pytest.mark.parametrize(("k", "seed", "copies"), [
    (16, 11, 2), (24, 12, 2), (24, 14, 3), (48, 15, 2), (72, 16, 3), (96, 17, 3)])
def test_float32_copies_at_any_norms_have_equal_projections_on_their_gramian(
        k: int, seed: int, copies: int) -> None:
    """In float32 the copies are copies only to the product's rounding, over norms 12
    decades apart: the exact rows' update is out of reach (the rounding moves it by more
    than itself), but IMTL-G's defining property holds on the Gramian the rule reads, the
    product with its rounding removed: ``(Gw)ₖ/√Gₖₖ`` equal for every task, ``Σw = 1``.
    The shortest solution from the kept spectrum meets it; the pseudo-inverse of the
    Gramian, taken where ``1`` missed the cosine matrix's range by the rounding, missed it
    by 85 % (K = 16)."""
    rows = torch.tensor(_uneven_rows(k, seed, copies), dtype=torch.float32)
    gram, _ = cleaned(compute_gramian(rows).double(), products_rounding(rows))
    w = IMTLG().combine(rows).weights.double()
    assert abs(float(w.sum()) - 1.0) <= 1e-9
    projections = (gram @ w) / torch.diagonal(gram).sqrt()
    spread = float((projections.max() - projections.min()) / projections.abs().max())
    assert spread <= 1e-5, spread
