"""An embedding's per-sample gradients as token rows, and the inner products between them.

Sample i's gradient of an ``nn.Embedding`` table is ``Σₛ e_{xᵢₛ} Dᵢₛᵀ``: zero but on the rows of
the tokens the sample uses. :func:`token_rows` keeps only those, one summed output gradient
per (sample, token) (the padding id left out), ``[r, d]`` for ``r ≤ n·S`` (not ``n·V·d``);
:func:`token_block` gives ``⟨gᵢ, gⱼ⟩ = Σ_v ⟨Rᵢᵥ, Rⱼᵥ⟩``, from the pairs of rows that share a
token or, where a token is in most samples (positions), from the rows of the tokens used,
whichever costs less (docs/per_sample.md, "Layers").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["TokenRows", "token_block", "token_rows"]

#: A gathered pair's product against one multiply-add of a matrix product (time per element).
_GATHER_COST = 8
#: Pair elements (pairs × d) formed at once: bounds the pairs' memory.
_CHUNK = 1 << 22


@dataclass(frozen=True)
class TokenRows:
    """``n`` samples' gradients of a ``[vocab, d]`` table: row ``rows[r]`` at (``samples[r]``,
    ``tokens[r]``), one per (sample, token) used, zero elsewhere."""

    n: int
    vocab: int
    samples: Tensor
    tokens: Tensor
    rows: Tensor

    def dense(self) -> Tensor:
        """The gradients materialised, ``[n, vocab·d]``."""
        out = self.rows.new_zeros(self.n, self.vocab, self.rows.shape[1])
        out[self.samples, self.tokens] = self.rows
        return out.flatten(1)


def token_rows(ids: Tensor, d: Tensor, module: nn.Embedding, dtype: torch.dtype) -> TokenRows:
    """The token rows of ``module``'s per-sample gradients from its ids ``[n, S]`` and output
    gradient rows ``d`` ``[n, S, o]`` (summed in ``dtype``)."""
    n, seq = ids.shape
    keys = (torch.arange(n, device=ids.device)[:, None] * module.num_embeddings + ids)
    keys, rows = keys.reshape(-1), d.reshape(n * seq, -1).to(dtype)
    if module.padding_idx is not None:
        kept = ids.reshape(-1) != module.padding_idx
        keys, rows = keys[kept], rows[kept]
    unique, position = torch.unique(keys, return_inverse=True)
    summed = rows.new_zeros(unique.numel(), rows.shape[1]).index_add_(0, position, rows)
    return TokenRows(n, module.num_embeddings, unique // module.num_embeddings,
                     unique % module.num_embeddings, summed)


def token_block(left: TokenRows, right: TokenRows) -> Tensor:
    """``[nₗ, nᵣ]`` float64: ``⟨gᵢ, gⱼ⟩`` between ``left``'s and ``right``'s gradients (of the
    same table), from the pairs of rows sharing a token, or from the rows of the tokens both
    use where that costs less."""
    order = torch.argsort(right.tokens)
    sorted_tokens = right.tokens[order]
    start = torch.searchsorted(sorted_tokens, left.tokens)
    count = torch.searchsorted(sorted_tokens, left.tokens, right=True) - start
    pairs = int(count.sum())
    used = torch.unique(torch.cat([left.tokens, right.tokens])).numel()
    if pairs * _GATHER_COST > left.n * right.n * used:
        return _compact_product(left, right)
    out = torch.zeros(left.n * right.n, dtype=torch.float64, device=left.rows.device)
    ends = torch.cumsum(count, 0)
    width = max(1, left.rows.shape[1])
    at = 0
    while at < count.numel():  # rows of left whose pairs fit in one chunk
        stop = int(torch.searchsorted(ends, int(ends[at] - count[at]) + _CHUNK // width,
                                      right=True))
        stop = max(stop, at + 1)
        c = count[at:stop]
        mine = torch.arange(at, stop, device=c.device).repeat_interleave(c)
        offset = torch.arange(int(c.sum()), device=c.device) - (
            torch.cumsum(c, 0) - c).repeat_interleave(c)
        theirs = order[start[at:stop].repeat_interleave(c) + offset]
        dots = (left.rows[mine] * right.rows[theirs]).sum(1).double()
        out.index_add_(0, left.samples[mine] * right.n + right.samples[theirs], dots)
        at = stop
    return out.view(left.n, right.n)


def _compact_product(left: TokenRows, right: TokenRows) -> Tensor:
    """The block as one matrix product over the columns of the tokens used."""
    tokens, where = torch.unique(torch.cat([left.tokens, right.tokens]), return_inverse=True)
    dense = []
    for part, columns in ((left, where[: left.tokens.numel()]),
                          (right, where[left.tokens.numel():])):
        out = part.rows.new_zeros(part.n, tokens.numel(), part.rows.shape[1])
        out[part.samples, columns] = part.rows
        dense.append(out.flatten(1))
    dtype = torch.promote_types(dense[0].dtype, dense[1].dtype)
    return (dense[0].to(dtype) @ dense[1].to(dtype).T).double()
