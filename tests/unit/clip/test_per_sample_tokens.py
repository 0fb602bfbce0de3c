"""An embedding's per-sample gradients as token rows (``gradbalance.clip._per_sample_tokens``).

The reference is independent: each sample's gradient of the table by its own
``autograd.grad`` through ``nn.Embedding``, and the Gram matrix of those rows in float64.
Both block routes (pairs of rows sharing a token; one product over the tokens used) and the
chunking of the pairs are forced in turn.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gradbalance._per_sample_forms import _self_gram
from gradbalance.clip import _per_sample_tokens as tokens
from gradbalance.clip._per_sample_tokens import token_block, token_rows


def _per_sample(emb: nn.Embedding, ids: Tensor, d: Tensor) -> Tensor:
    """Sample i's gradient of ``Σₛ ⟨emb(xᵢₛ), dᵢₛ⟩``, one ``autograd.grad`` each, ``[n, V·d]``."""
    return torch.stack([torch.autograd.grad((emb(ids[i]) * d[i]).sum(), emb.weight)[0].flatten()
                        for i in range(ids.shape[0])])


@st.composite
def _batches(draw: st.DrawFn) -> tuple[int, int | None, Tensor, Tensor, Tensor, Tensor]:
    vocab = draw(st.integers(1, 30))
    width = draw(st.integers(1, 4))
    padding = draw(st.one_of(st.none(), st.integers(0, vocab - 1)))
    seq = draw(st.integers(1, 6))
    used = draw(st.integers(1, vocab))  # a narrow draw: tokens shared by most samples
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    sizes = draw(st.integers(1, 7)), draw(st.integers(1, 7))
    ids = [torch.randint(0, used, (n, seq), generator=gen) for n in sizes]
    ds = [torch.randn(n, seq, width, generator=gen, dtype=torch.float64) for n in sizes]
    return vocab, padding, ids[0], ds[0], ids[1], ds[1]


@pytest.mark.parametrize("route", ["pairs", "compact", "chunked"])
@settings(max_examples=60, deadline=None)
@given(batch=_batches())
def test_token_block_equals_per_sample_autograd(
        route: str, batch: tuple[int, int | None, Tensor, Tensor, Tensor, Tensor]) -> None:
    """Within a micro-batch and across two, padding ids and shared tokens included."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tokens, "_GATHER_COST", 10**9 if route == "compact" else 0)
        patch.setattr(tokens, "_CHUNK", 1 if route == "chunked" else 1 << 22)
        _check_blocks(*batch)


def _check_blocks(vocab: int, padding: int | None, ids_a: Tensor, d_a: Tensor, ids_b: Tensor,
                  d_b: Tensor) -> None:
    emb = nn.Embedding(vocab, d_a.shape[2], padding_idx=padding).double()
    left = token_rows(ids_a, d_a, emb, torch.float64)
    right = token_rows(ids_b, d_b, emb, torch.float64)
    rows_a, rows_b = _per_sample(emb, ids_a, d_a), _per_sample(emb, ids_b, d_b)
    assert torch.allclose(left.dense(), rows_a, rtol=1e-12, atol=1e-12)
    for got, want in ((token_block(left, left), rows_a @ rows_a.T),
                      (token_block(left, right), rows_a @ rows_b.T)):
        assert got.dtype == torch.float64
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)


def test_every_id_the_padding_gives_zero_blocks() -> None:
    emb = nn.Embedding(4, 2, padding_idx=1)
    rows = token_rows(torch.ones(3, 5, dtype=torch.long), torch.randn(3, 5, 2), emb,
                      torch.float32)
    assert rows.rows.shape == (0, 2)
    assert torch.equal(token_block(rows, rows), torch.zeros(3, 3, dtype=torch.float64))


@pytest.mark.parametrize("n", [1, 2, 5])
def test_self_gram_equals_the_full_product(n: int) -> None:
    """The lower half mirrored equals ``M Mᵀ`` in float64, odd and single rows included."""
    m = torch.randn(n, 7, dtype=torch.float64)
    assert torch.allclose(_self_gram(m), m @ m.T, rtol=1e-14, atol=1e-14)
