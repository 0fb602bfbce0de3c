"""Per-sample gradient forms of one parameter and the Gramian blocks between them.

A layer's site holds sample i's gradient as an outer form ``Aᵢᵀ Bᵢ`` (rows ``[n, S, m]``,
``[n, S, k]``), materialised ``[n, numel]``, or, for an embedding table, as token rows (one
summed row per sample and token used, :mod:`gradbalance.clip._per_sample_tokens`).
:func:`contracted` keeps the cheaper of the outer form and the materialised one for the
Gramian, as soon as the layer's output gradient is known (the rows of the other form are then
dropped); :func:`block` gives ``⟨gᵢ, gⱼ⟩`` between two forms, ``[nₐ, n_b]`` float64:
``Σₛₜ (Aᵢₛ·Aⱼₜ)(Bᵢₛ·Bⱼₜ)`` for two outer forms (the ghost-norm identity), the products of
the rows sharing a token for two token rows, ``Gₐ G_bᵀ`` otherwise. Products run in the
forms' dtype (float32 inputs stay float32, float64 ones float64); the Gram form's sums over
positions accumulate in float64 (docs/per_sample.md, "Layers").
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .clip._per_sample_tied import Site, materialised, site_form
from .clip._per_sample_tokens import TokenRows, token_block, token_rows

__all__ = ["Form", "block", "contracted", "layer_form", "summed_blocks"]

Form = tuple[Tensor, Tensor] | Tensor | TokenRows


def _dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _gram_form_cheaper(n: int, s: int, m: int, k: int) -> bool:
    """Whether the Gram form of ``n`` samples' ``[S, m]``, ``[S, k]`` rows, ``(n·S)²·(m + k)``,
    costs no more than materialising them and their products, ``n·S·m·k + n²·m·k``."""
    rows = n * s
    return rows * rows * (m + k) <= rows * m * k + n * n * m * k


def contracted(form: Form) -> Form:
    """``form`` as kept for the Gramian: an outer form materialised ``[n, numel]`` (its
    dtype) where that is cheaper (:func:`_gram_form_cheaper`); else unchanged."""
    if not isinstance(form, tuple):
        return form
    n, s, m = form[0].shape
    if _gram_form_cheaper(n, s, m, form[1].shape[2]):
        return form
    return materialised([form], _dtype(*form))


def layer_form(module: nn.Module, is_weight: bool, x: Tensor, d: Tensor, k: int = 1) -> Form:
    """The contracted form of one site (:func:`contracted`): its layer's input rows ``x``
    (token ids ``[n, S]`` for an embedding) and output gradient rows ``d`` ``[n·k, S, o]``
    (``k`` objectives per sample, each sample's input shared by its ``k``). An embedding
    table's per-sample gradients are token rows, not one-hot products; a weight of linear
    form materialised for ``k > 1`` is ``k`` objectives' products at once
    (:func:`_grouped_materialised`), its input not repeated."""
    plain = is_weight and not isinstance(module, (nn.Embedding, nn.LayerNorm))
    if k > 1 and plain and not _gram_form_cheaper(d.shape[0], d.shape[1], x.shape[2],
                                                   d.shape[2]):
        return _grouped_materialised(x, d, k)
    if k > 1 and is_weight:  # a bias's form is its output gradient's alone
        x = x.repeat_interleave(k, 0)
    if not (is_weight and isinstance(module, nn.Embedding)) or _gram_form_cheaper(
            x.shape[0], x.shape[1], module.num_embeddings, d.shape[2]):
        return contracted(site_form(Site(module, is_weight), x, d))
    return token_rows(x, d, module, _dtype(d))


def _grouped_materialised(x: Tensor, d: Tensor, k: int) -> Tensor:
    """``[n·k, o·m]``: objective ``(i, t)``'s gradient ``d_{it}ᵀ xᵢ`` (``x`` ``[n, S, m]``,
    ``d`` ``[n·k, S, o]``), one batched product of ``[k·o, S] × [S, m]`` per sample."""
    dtype = _dtype(x, d)
    n, s, m = x.shape
    o = d.shape[2]
    dk = d.to(dtype).reshape(n, k, s, o).transpose(2, 3).reshape(n, k * o, s)
    return (dk @ x.to(dtype)).reshape(n * k, o * m)


def _dense(form: Form) -> Tensor:
    """``form``'s per-sample gradients materialised, ``[n, numel]``."""
    if isinstance(form, TokenRows):
        return form.dense()
    return form if isinstance(form, Tensor) else materialised([form], _dtype(*form))


def _self_gram(dense: Tensor) -> Tensor:
    """``M Mᵀ`` (float64) of materialised gradients ``M`` ``[n, numel]`` from its lower half:
    the last rows against every row, the first ones against themselves (¾ of the products),
    the rest mirrored; in at least float32 (a fallback module's bfloat16 rows too)."""
    dense = dense.to(_dtype(dense))
    half = dense.shape[0] // 2
    gram = dense.new_empty(dense.shape[0], dense.shape[0])
    gram[:half, :half] = dense[:half] @ dense[:half].T
    gram[half:] = dense[half:] @ dense.T
    gram[:half, half:] = gram[half:, :half].T
    return gram.double()


def block(left: Form, right: Form) -> Tensor:
    """``[nₗ, nᵣ]`` float64: the inner products of ``left``'s per-sample gradients with
    ``right``'s (forms of the same parameter)."""
    if isinstance(left, TokenRows) and isinstance(right, TokenRows):
        return token_block(left, right)
    if not (isinstance(left, tuple) and isinstance(right, tuple)):
        if left is right:
            return _self_gram(_dense(left))
        dense = [_dense(left), _dense(right)]
        dtype = _dtype(*dense)
        return (dense[0].to(dtype) @ dense[1].to(dtype).T).double()
    dtype = _dtype(*left, *right)
    (a, b), (c, e) = left, right
    n, s = a.shape[:2]
    n2, s2 = c.shape[:2]
    first = a.reshape(n * s, -1).to(dtype) @ c.reshape(n2 * s2, -1).to(dtype).T
    second = b.reshape(n * s, -1).to(dtype) @ e.reshape(n2 * s2, -1).to(dtype).T
    return (first * second).reshape(n, s, n2, s2).sum((1, 3), dtype=torch.float64)


def summed_blocks(left: list[Form], right: list[Form]) -> Tensor:
    """Σ of the blocks between every form of ``left`` and every one of ``right`` (``left``
    with itself where ``right`` is empty)."""
    total: Tensor | None = None
    for a in left:
        for b in right or left:
            total = block(a, b) if total is None else total + block(a, b)
    assert total is not None
    return total
