"""The per-sample gradient of a parameter as the sum of its sites' outer forms ``Aᵢᵀ Bᵢ``
(tied or reused weights included, cross terms and all), and its p-th power norm: the cheaper
of the Gram form and the materialised gradient (docs/loop.md, "Per-sample clipping")."""

from __future__ import annotations

from collections.abc import Callable
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
    if not site.is_weight:  # a bias: Σₛ Dₛ
        return d.sum(dim=1)
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


def _stacked(outer: list[tuple[Tensor, Tensor]], side: int, dtype: torch.dtype) -> Tensor:
    """The sites' ``A`` (``side`` 0) or ``B`` rows stacked along S; one site's are not copied."""
    rows = [form[side].to(dtype) for form in outer]
    return rows[0] if len(rows) == 1 else torch.cat(rows, 1)


def tied_powers(forms: list[tuple[Tensor, Tensor] | Tensor], norm_type: float,
                b_gram: Callable[[], Tensor] | None = None) -> Tensor:
    """Per-sample ``‖Σ_sites ∇‖ᵖ`` (float64 ``[B]``) of one parameter from its sites' forms:
    the Gram form ``Σ (A Aᵀ) ⊙ (B Bᵀ)`` of the stacked outer forms where cheaper (p = 2),
    else the materialised gradient. ``b_gram``: ``B Bᵀ`` (float64) where the caller keeps it
    (a layer's inputs, the same for every task)."""
    parts = [t for form in forms for t in ((form,) if isinstance(form, Tensor) else form)]
    dtype = torch.float32
    for t in parts:
        dtype = torch.promote_types(dtype, t.dtype)
    outer = [form for form in forms if not isinstance(form, Tensor)]
    if norm_type == 2.0 and len(outer) == len(forms):
        a, b = _stacked(outer, 0, dtype), _stacked(outer, 1, dtype)
        s, m, n = a.shape[1], a.shape[2], b.shape[2]
        if s * s * (m + n) < s * m * n:
            bb = (b @ b.transpose(1, 2)).double() if b_gram is None else b_gram()
            gram = (a @ a.transpose(1, 2)).double() * bb
            return gram.sum(dim=(1, 2)).clamp_min(0)
    norms = torch.linalg.vector_norm(materialised(forms, dtype), norm_type, dim=1)
    powers: Tensor = norms.double() ** norm_type
    return powers
