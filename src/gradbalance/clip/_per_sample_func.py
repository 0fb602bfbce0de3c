"""Per-sample gradient norms from the model itself: each sample one lane of
``vmap(jacrev(...))`` (``torch.func``), linear in the batch (docs/loop.md, "Per-sample
clipping")."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev, vmap

from .._checks import check_bool, check_module, check_norm_type, check_optional_int
from ._per_sample_graph import _CHUNK_ELEMENTS, batched_norms
from ._per_sample_layers import refuse_training_batch_norm

__all__ = ["per_sample_grad_norms_of_model"]

LossFn = Callable[[Any, Tensor], Tensor]


def _trainable(module: nn.Module, params: Iterable[Tensor] | None) -> dict[str, Tensor]:
    check_module("model", module)
    named: dict[str, Tensor] = {
        name: p for name, p in module.named_parameters() if p.requires_grad
    }
    if params is None:
        return named
    wanted = {id(p) for p in params}
    chosen: dict[str, Tensor] = {name: p for name, p in named.items() if id(p) in wanted}
    if len(chosen) != len(wanted):
        raise ValueError(
            f"params holds {len(wanted) - len(chosen)} tensor(s) that are not trainable "
            f"parameters of the module; pass parameters of `module` (or None for all)"
        )
    return chosen


def per_sample_grad_norms_of_model(
        module: nn.Module, loss_fn: LossFn, inputs: Tensor, targets: Tensor, *,
        params: Iterable[Tensor] | None = None, norm_type: float = 2.0, per_task: bool = True,
        chunk_size: int | None = None, scale: float = 1.0) -> Tensor:
    """Norms of the per-sample gradients ``‖∇θ ℓᵢₖ‖`` ``[B, K]`` (``[B]`` for one task).

    ``loss_fn(module(inputs), targets)`` must return the per-sample losses ``[B]`` or
    ``[B, K]`` (``reduction='none'``); it is evaluated on one sample at a time. ``params``:
    the parameters bounded (default: every trainable parameter of ``module``);
    ``per_task=False``: the norm of ``∇Σₖ ℓᵢₖ`` per sample. ``chunk_size``: samples per vmap
    call (default: as many as fit 2^26 gradient entries). ``scale``: differentiate
    ``scale·ℓ`` and divide the norms by it (fp16 autocast). ``.grad`` is untouched, no graph
    is kept.

    Example:
        >>> import torch
        >>> from gradbalance.clip import per_sample_grad_norms_of_model
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> x = torch.tensor([[3.0, 4.0], [0.0, 2.0]])
        >>> def loss_fn(out, y):  # per-sample losses [B]; sample i's gradient is y_i · x_i
        ...     return out[:, 0] * y
        >>> per_sample_grad_norms_of_model(model, loss_fn, x, torch.ones(2))
        tensor([5., 2.])
    """
    norm_type = check_norm_type("norm_type", norm_type)
    chunk_size = check_optional_int("chunk_size", chunk_size, 1)
    per_task = check_bool("per_task", per_task)
    _check_batch_pair(inputs, targets)
    trained = _trainable(module, params)
    if not trained:
        raise ValueError("module has no trainable parameters to bound")
    refuse_training_batch_norm([("", module)], "")  # before any forward
    fixed = {name: p.detach() for name, p in module.named_parameters() if name not in trained}
    # copies: a forward that writes a buffer (a running count) writes none of the module's
    fixed.update({name: b.clone() for name, b in module.named_buffers()})
    detached = {name: p.detach() for name, p in trained.items()}

    def sample_losses(theta: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        out = functional_call(module, {**theta, **fixed}, (x.unsqueeze(0),))
        losses = loss_fn(out, y.unsqueeze(0)).reshape(-1) * scale
        return losses if per_task else losses.sum().reshape(1)

    if chunk_size is None:
        chunk_size = _default_chunk(sample_losses, detached, inputs, targets)
    jac = vmap(jacrev(sample_losses), in_dims=(None, 0, 0), chunk_size=chunk_size)
    parts = [_chunk_norms(jac, detached, inputs[start : start + chunk_size],
                          targets[start : start + chunk_size], norm_type)
             for start in range(0, inputs.shape[0], chunk_size)]
    norms = torch.cat(parts) / scale  # [B, K], or [B, 1] for one task / per_task=False
    return norms[:, 0] if norms.shape[1] == 1 else norms


def _check_batch_pair(inputs: object, targets: object) -> None:
    """``inputs`` and ``targets`` are tensors with the same first (batch) dimension."""
    if not isinstance(inputs, Tensor) or not isinstance(targets, Tensor) or (
        inputs.shape[0] != targets.shape[0]
    ):
        raise ValueError(
            f"inputs and targets must be tensors with the same first (batch) dimension, got "
            f"{getattr(inputs, 'shape', type(inputs).__name__)} and "
            f"{getattr(targets, 'shape', type(targets).__name__)}"
        )


def _default_chunk(sample_losses: Callable[[dict[str, Tensor], Tensor, Tensor], Tensor],
                   theta: dict[str, Tensor], inputs: Tensor, targets: Tensor) -> int:
    """Samples per vmap call: as many as fit ``_CHUNK_ELEMENTS`` gradient entries (K from
    one probe sample)."""
    devices = [inputs.device] if inputs.device.type != "cpu" else []
    with torch.no_grad(), torch.random.fork_rng(devices):  # the generators as they were
        probe_k = sample_losses(theta, inputs[0], targets[0]).numel()
    numel = sum(p.numel() for p in theta.values())
    return max(1, min(inputs.shape[0], _CHUNK_ELEMENTS // max(numel * probe_k, 1)))


def _chunk_norms(jac: Callable[..., dict[str, Tensor]], theta: dict[str, Tensor],
                 inputs: Tensor, targets: Tensor, norm_type: float) -> Tensor:
    """The per-sample gradient norms ``[b, K]`` of one chunk of samples."""
    with warnings.catch_warnings():  # ops without a batching rule run lane by lane
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        grads = jac(theta, inputs, targets)  # [b, K, ...] each
    rows = inputs.shape[0] * next(iter(grads.values())).shape[1]  # b·K
    return batched_norms(list(grads.values()), rows, norm_type, inputs).view(inputs.shape[0], -1)
