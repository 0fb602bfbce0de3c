"""A step's weighted update ``Σᵢ wᵢ gᵢ`` from its layers' operands, without a second backward.

Sample i's gradient of a covered layer's weight is the outer form ``Dᵢᵀ Xᵢ`` of its output
gradient and input rows (:mod:`gradbalance.clip._per_sample_layers`), so the weighted sum over
the samples is one product over all their rows, ``(w ⊙ D)ᵀ X``: the weight-gradient kernel of
a plain backward whose output gradient is ``w ⊙ D`` (a convolution's is that kernel itself, on
the recorded input: no unfolded patches). A bias's is ``Σᵢₛ wᵢ Dᵢₛ``, a
LayerNorm weight's ``Σᵢₛ wᵢ Dᵢₛ ⊙ X̂ᵢₛ``, an embedding table's the ``wᵢ Dᵢₛ`` added at the
tokens' rows. The output gradients are those the per-sample Gramian's backward took, kept
until the weights are known; the update equals ``∇ Σᵢ wᵢ ℓᵢ`` through the graph to rounding
(docs/per_sample.md, "What it computes").

Example:
    >>> import torch
    >>> from torch import nn
    >>> layer = nn.Linear(3, 2)
    >>> x, d, w = torch.randn(4, 1, 3), torch.randn(4, 1, 2), torch.rand(4)
    >>> got = site_sum(layer, True, x, d * w[:, None, None])
    >>> want = torch.einsum("b,bo,bi->oi", w, d[:, 0], x[:, 0])  # Σᵢ wᵢ Dᵢᵀ Xᵢ
    >>> bool(torch.allclose(got, want.flatten()))
    True
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.grad import conv1d_weight, conv2d_weight

from .clip._per_sample_layers import HookedLayer
from .clip._per_sample_tied import Site, site_form

__all__ = ["CONVOLUTIONS", "LayerOperands", "combined_grads", "conv_sum", "site_sum"]

#: The layers whose sums come from the convolution's weight-gradient kernel (:func:`conv_sum`).
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d)


@dataclass(frozen=True)
class LayerOperands:
    """One layer's recorded inputs and its output gradients ``[task][call]`` (zeros where an
    output is off a task's graph), kept for the weighted update."""

    layer: HookedLayer
    inputs: list[Tensor]
    grads: list[list[Tensor]]


def combined_grads(grads: list[list[Tensor]], weights: Tensor) -> list[Tensor]:
    """Each call's output gradient ``Σₖ wᵢₖ Dᵢₖ`` (sample i's along dim 0, at least
    float32, as the forms are) from the K tasks' ``grads`` ``[task][call]`` and the weights
    ``[B·K]`` (objective ``(i, k)`` at ``i·K + k``): one product per layer, not K."""
    w = weights.reshape(-1, len(grads))
    out: list[Tensor] = []
    for call in range(len(grads[0])):
        total: Tensor | None = None
        for k, task in enumerate(grads):
            g = task[call]
            dtype = torch.promote_types(g.dtype, torch.float32)
            part = g.to(dtype) * w[:, k].to(g.device, dtype).reshape(-1, *[1] * (g.dim() - 1))
            total = part if total is None else total + part
        assert total is not None
        out.append(total)
    return out


def conv_sum(module: nn.Conv1d | nn.Conv2d, is_weight: bool, inputs: list[Tensor],
             grads: list[Tensor]) -> Tensor:
    """``Σᵢ`` of a convolution's per-sample weight (or bias) gradients over its calls,
    flattened, from each call's input and (weighted) output gradient: the kernel a plain
    backward runs (``torch.nn.grad``)."""
    total: Tensor | None = None
    for x, g in zip(inputs, grads):
        if not is_weight:
            part = g.sum(dim=[0, *range(2, g.dim())])
        else:
            kernel = conv2d_weight if isinstance(module, nn.Conv2d) else conv1d_weight
            part = kernel(x.to(g.dtype), module.weight.shape, g,  # type: ignore[no-untyped-call]
                          module.stride, module.padding, module.dilation, module.groups)
        total = part if total is None else total + part
    assert total is not None
    return total.flatten()


def site_sum(module: nn.Module, is_weight: bool, x: Tensor, d: Tensor) -> Tensor:
    """``Σᵢ`` of the site's per-sample gradients (flattened, ``[numel]``) from its input rows
    ``x`` (token ids ``[N, S]`` for an embedding) and output gradient rows ``d`` ``[N, S, o]``
    (already weighted: :func:`combined_grads`)."""
    if is_weight and isinstance(module, nn.Embedding):
        ids, rows = x.reshape(-1), d.reshape(-1, d.shape[-1])
        if module.padding_idx is not None:
            rows = rows * (ids != module.padding_idx).unsqueeze(1).to(rows.dtype)
        table = rows.new_zeros(module.num_embeddings, rows.shape[1])
        return table.index_add_(0, ids, rows).flatten()
    form = site_form(Site(module, is_weight), x, d)
    if isinstance(form, Tensor):
        return form.sum(dim=0)
    a, b = form
    return (a.flatten(0, 1).T @ b.flatten(0, 1)).flatten()
