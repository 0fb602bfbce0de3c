"""Per-sample gradient norms of a weight used at several sites (tied or reused weights).

A weight held by several layers (embedding/output tying in language models, one weight in two
linear layers) gets, per sample, the sum of its sites' gradients, so its norm has cross terms
between the sites that a per-layer ghost norm misses. Each site's gradient of sample i is an
outer form ``Aᵢᵀ Bᵢ`` (``Aᵢ`` ``[S, m]``, ``Bᵢ`` ``[S, n]``, the weight seen as ``[m, n]``):

* linear or convolution weight: ``A = D`` (output gradients), ``B = X`` (inputs or patches);
* embedding weight: ``A = O`` (the one-hot token ids, a padding token's row zero),
  ``B = D``; bias: ``A = D``, ``B = 1``;

or a dense vector (a LayerNorm weight's ``Σₛ Dₛ ⊙ x̂ₛ``). The sum over sites is one outer form
of the sites' rows stacked along S, ``[A₁; A₂]ᵀ [B₁; B₂]``, so the ghost-norm identity holds
with every cross term included:

    ‖Σ_s Aₛᵀ Bₛ‖² = Σ_{s,t} ⟨Aₛ Aₜᵀ, Bₛ Bₜᵀ⟩ = ‖(A Aᵀ) ⊙ (B Bᵀ)‖₁-sum

(Goodfellow 2015; Li et al. 2022, ghost clipping). Per sample the cheaper of this Gram form
(``S²·(m + n)``) and the materialised ``Aᵀ B`` (``S·m·n``) is taken; a p-norm other than 2, or
a dense site, materialises (docs/loop.md, per-sample clipping).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Site", "materialised", "site_form", "tied_powers"]


@dataclass(frozen=True)
class Site:
    """One use of a weight: the layer that holds it, and whether it is the layer's weight."""

    module: nn.Module
    is_weight: bool


def site_form(site: Site, x: Tensor, d: Tensor) -> tuple[Tensor, Tensor] | Tensor:
    """The site's per-sample gradient: an outer form ``(A, B)`` ``[B, S, m]``, ``[B, S, n]``
    or a dense ``[B, numel]``, from the layer's input rows ``x`` (token ids ``[B, S]`` for an
    embedding) and its output gradient rows ``d`` ``[B, S, o]``."""
    dtype = torch.promote_types(d.dtype, torch.float32)  # autocast: 16-bit output gradients
    if x.is_floating_point():
        dtype = torch.promote_types(dtype, x.dtype)
        x = x.to(dtype)
    d = d.to(dtype)
    m = site.module
    if not site.is_weight:
        return d, torch.ones(*d.shape[:2], 1, dtype=dtype, device=d.device)
    if isinstance(m, nn.Embedding):
        hot = nn.functional.one_hot(x, m.num_embeddings).to(dtype)
        if m.padding_idx is not None:
            hot = hot * (x != m.padding_idx).unsqueeze(-1).to(dtype)
        return hot, d
    if isinstance(m, nn.LayerNorm):
        return (d * x).sum(dim=1)
    return d, x


def materialised(forms: list[tuple[Tensor, Tensor] | Tensor], dtype: torch.dtype) -> Tensor:
    """``Σ`` of the sites' per-sample gradients, flattened ``[B, numel]``."""
    total: Tensor | None = None
    for form in forms:
        grad = (form.to(dtype) if isinstance(form, Tensor)
                else form[0].to(dtype).transpose(1, 2) @ form[1].to(dtype)).flatten(1)
        total = grad if total is None else total + grad
    assert total is not None
    return total


def tied_powers(forms: list[tuple[Tensor, Tensor] | Tensor], norm_type: float) -> Tensor:
    """Per-sample ``‖Σ_sites ∇‖ᵖ`` (float64 ``[B]``) of one weight from its sites' forms."""
    parts = [t for form in forms for t in ((form,) if isinstance(form, Tensor) else form)]
    dtype = torch.float32
    for t in parts:
        dtype = torch.promote_types(dtype, t.dtype)
    outer = [form for form in forms if not isinstance(form, Tensor)]
    if norm_type == 2.0 and len(outer) == len(forms):
        a = torch.cat([form[0].to(dtype) for form in outer], 1)
        b = torch.cat([form[1].to(dtype) for form in outer], 1)
        s, m, n = a.shape[1], a.shape[2], b.shape[2]
        if s * s * (m + n) < s * m * n:
            gram = (a @ a.transpose(1, 2)).double() * (b @ b.transpose(1, 2)).double()
            return gram.sum(dim=(1, 2)).clamp_min(0)
    norms = torch.linalg.vector_norm(materialised(forms, dtype), norm_type, dim=1)
    powers: Tensor = norms.double() ** norm_type
    return powers
