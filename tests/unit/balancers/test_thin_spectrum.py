"""IMTL-G and Aligned-MTL on a low-rank Gramian of rows whose norms spread over decades: the
kept spectrum's thin SVD of its factor (``KeptSpectrum.thin_eigen``, ``O(Kr²)``) replaces a
second ``K × K`` decomposition, and the update is the one numpy's pseudo-inverse and
eigen-decomposition of the same cleaned Gramian give (an independent reference)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradbalance.balancers._alignedmtl import alignedmtl_weights
from gradbalance.balancers._denoise import cleaned
from gradbalance.balancers._imtlg import imtlg_weights
from gradbalance.gramian import compute_gramian, products_rounding


def _rows(k: int, rank: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(rank, 300, generator=gen)
    mix = torch.randn(k, rank, generator=gen)
    scales = torch.logspace(-5, 5, k)[torch.randperm(k, generator=gen)]
    return (mix @ basis * scales[:, None]).float()


def _update_close(w: torch.Tensor, reference: np.ndarray, rows: np.ndarray) -> None:
    got, want = w.numpy() @ rows, reference @ rows
    cos = got @ want / (np.linalg.norm(got) * np.linalg.norm(want))
    assert cos >= 1 - 1e-9, cos
    assert abs(np.linalg.norm(got) - np.linalg.norm(want)) <= 1e-8 * np.linalg.norm(want)


@pytest.mark.parametrize("k,rank", [(16, 1), (40, 3), (96, 8), (96, 20)])
@pytest.mark.parametrize("seed", [0, 1])
def test_thin_route_matches_numpy_on_the_cleaned_gramian(k: int, rank: int, seed: int) -> None:
    rows = _rows(k, rank, seed)
    gram, spectrum = cleaned(compute_gramian(rows).double(), products_rounding(rows))
    assert spectrum is not None and spectrum.vectors.shape[1] == rank
    assert not spectrum.norms_within(1e3) and spectrum.thin_eigen() is not None
    g = gram.numpy()
    dense = rows.double().numpy()

    d = np.sqrt(np.clip(np.diag(g), 0, None))
    v = np.linalg.pinv(g / np.trace(g), hermitian=True, rcond=1e-12) @ d / np.sqrt(np.trace(g))
    _update_close(imtlg_weights(gram, spectrum=spectrum), v / v.sum(), dense)

    lam, vec = np.linalg.eigh(g / np.trace(g))
    keep = lam > lam.max() * k * np.finfo(np.float64).eps
    lam, vec = lam[keep], vec[:, keep]
    reference = np.sqrt(lam.min()) * (vec @ ((vec.T @ np.ones(k)) / np.sqrt(lam)))
    _update_close(alignedmtl_weights(gram, spectrum=spectrum), reference, dense)


@pytest.mark.parametrize("k,rank", [(40, 3), (96, 8)])
def test_imtlg_takes_no_decomposition_of_its_own_where_one_is_off_the_range(
        k: int, rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``1`` is far outside the cosine matrix's range (rank ``r`` < K): ``Gv = d`` has no
    solution, so IMTL-G's shortest-solution route has nothing to find and the update comes
    from the kept spectrum alone, with no ``K × K`` eigen-decomposition of its own."""
    rows = _rows(k, rank, 2)
    gram, spectrum = cleaned(compute_gramian(rows).double(), products_rounding(rows))
    assert spectrum is not None
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda *a, **kw: calls.append(1) or eigh(*a, **kw))
    w = imtlg_weights(gram, spectrum=spectrum)
    assert not calls
    g = gram.numpy()
    d = np.sqrt(np.clip(np.diag(g), 0, None))
    v = np.linalg.pinv(g / np.trace(g), hermitian=True, rcond=1e-12) @ d / np.sqrt(np.trace(g))
    _update_close(w, v / v.sum(), rows.double().numpy())
