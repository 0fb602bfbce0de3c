"""Per-sample parameter gradients of a layer the outer-form identity does not cover.

For a module ``y = f(args; θ)`` whose output rows ``yᵢ`` hold sample i, sample i's gradient of
``θ`` is the vector-Jacobian product of ``yᵢ`` with ``Dᵢ = ∂ℓᵢ/∂yᵢ``, the sample's output
gradient taken from the one backward of ``Σᵢ ℓᵢ`` (docs/per_sample.md, "Layers"):

1. **Vectorised**: one ``torch.func.vmap`` over ``torch.func.grad`` of the module called on one
   sample (every tensor argument whose dim 0 is the batch split by sample, the others shared),
   ``[B, numel]`` per parameter at once. Its rows must add up to the recorded call's gradient
   ``∂(Σᵢ Dᵢ·yᵢ)/∂θ``; they do not when the module draws random numbers (dropout), treats
   a shared argument of batch length as per-sample, or mixes its samples.
2. **Masked**, otherwise (and for bfloat16 or float16 parameters, whose rounding the check
   of route 1 cannot tell from a wrong split): the vector-Jacobian products of the recorded
   output itself with ``Dᵢ`` on sample i's rows and zeros elsewhere, batched
   (``is_grads_batched``), in chunks of at most :data:`MASKED_ELEMENTS` gradient elements.
   Exact for any module whose output rows are its samples (the dropout masks are the
   recorded ones), at the cost of one backward through the module per sample.
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_leaves, tree_unflatten

from ._batching import raised_by_model
from ._per_sample_eager import Recorded, edge_of
from .clip._per_sample_record import FallbackCall

__all__ = ["MASKED_ELEMENTS", "per_sample_grads"]

#: Elements of batched output gradients (per output) in one masked chunk: 64 MiB in float32.
MASKED_ELEMENTS = 1 << 24


def per_sample_grads(module: nn.Module, names: list[str], call: FallbackCall,
                     outputs: list[Tensor | Recorded], tasks: list[list[Tensor | None]],
                     name: str) -> list[Tensor]:
    """The per-sample gradients ``[B·K, numel]`` (objective ``(i, k)`` at row ``i·K + k``) of
    ``module``'s parameters ``names`` for one recorded ``call``, whose carried ``outputs``
    received the gradients ``tasks`` ``[task][output]`` (None: zeros). ``name`` names the
    layer in errors."""
    batch = call.first.shape[0]
    ds = _output_gradients(outputs, tasks, batch, name, type(module).__name__)
    params: list[Tensor] = [module.get_parameter(n) for n in names]
    if not ds:
        return [p.new_zeros(batch * len(tasks), p.numel()) for p in params]
    rows = None
    if not any(_half(p) for p in params):  # else the check below cannot tell a wrong split
        try:
            rows = _vectorised(module, names, params, call, ds, len(tasks))
        except Exception as error:  # a random op, an op vmap cannot batch, a forward that
            # refuses one sample at a time: the masked route (a hook's own error raises, as
            # under plain backward)
            if raised_by_model(error):
                raise
            rows = None
    with cut_at(call.stops):  # the module's own uses of its parameters in this call
        if rows is None or not _adds_up(rows, params, outputs, ds, len(tasks)):
            rows = _masked(params, outputs, ds, len(tasks))
    return [r.reshape(r.shape[0], -1) for r in rows]


def _half(p: Tensor) -> bool:
    """Whether ``p`` is bfloat16 or float16: the rows' check of :func:`_adds_up` allows 256
    of its ``eps`` (2⁻⁷ for bfloat16), more than rows from a wrong split miss by, so such a
    module takes the masked route, exact with any dtype."""
    return p.is_floating_point() and torch.finfo(p.dtype).bits <= 16


@contextmanager
def cut_at(stops: Collection[Node]) -> Iterator[None]:
    """Inside the block, a backward passes no gradient below the nodes ``stops`` (a call's
    arguments): the vector-Jacobian products of a call's outputs are then the call's alone,
    even where an argument was computed from the same parameters (the module called on its
    own output)."""
    handles = [node.register_prehook(_zeroed) for node in stops]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _zeroed(grads: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    return tuple(None if g is None else torch.zeros_like(g) for g in grads)


def _output_gradients(outputs: list[Tensor | Recorded], tasks: list[list[Tensor | None]],
                      batch: int, name: str, kind: str) -> dict[int, Tensor]:
    """Each carried output's gradients ``[B·K, ...]`` (row ``i·K + k``), for the outputs that
    received one; an output whose dim 0 is not the batch cannot be split by sample."""
    found: dict[int, Tensor] = {}
    for j, y in enumerate(outputs):
        got = [grads[j] for grads in tasks]
        if all(g is None for g in got):
            continue
        if len(y.shape) == 0 or y.shape[0] != batch:
            raise ValueError(
                f"layer {name!r} ({kind}) returned an output of shape {tuple(y.shape)} that "
                f"reaches the losses, but the batch ({batch} samples) must be its dim 0 to "
                f"split its gradient by sample: return batch-first outputs (e.g. "
                f"batch_first=True), or leave its parameters out of shared_params"
            )
        filled = [torch.zeros(y.shape, dtype=y.dtype, device=y.device) if g is None else g
                  for g in got]
        found[j] = torch.stack(filled, 1).flatten(0, 1)
    return found


def _vectorised(module: nn.Module, names: list[str], params: list[Tensor], call: FallbackCall,
                ds: dict[int, Tensor], k: int) -> list[Tensor]:
    """Route 1: ``vmap(grad(...))`` over the objectives, ``[B·K, *shape]`` per parameter."""
    batch = call.first.shape[0]
    split = [i for i, t in enumerate(call.leaves)
             if isinstance(t, Tensor) and t.dim() > 0 and t.shape[0] == batch]
    lanes = [call.leaves[i] if k == 1 else call.leaves[i].repeat_interleave(k, 0)
             for i in split]
    at = [call.carried[j] for j in ds]
    fixed = _fixed_state(module, params)

    def pulled(theta: dict[str, Tensor], xs: list[Tensor], gs: list[Tensor]) -> Tensor:
        leaves = list(call.leaves)
        for i, x in zip(split, xs):
            leaves[i] = x.unsqueeze(0)
        args, kwargs = tree_unflatten(leaves, call.spec)
        out = tree_leaves(functional_call(module, {**fixed, **theta}, tuple(args),
                                          dict(kwargs)))
        total: Tensor = sum(((out[i] * g.unsqueeze(0)).sum() for i, g in zip(at, gs)),
                            torch.zeros((), dtype=gs[0].dtype, device=gs[0].device))
        return total

    theta = {n: p.detach() for n, p in zip(names, params)}
    # the module's forward, already run (and warned about) in the step, again on one sample
    # at a time (a batch statistic of one sample warns); ops without a batching rule run lane
    # by lane (a performance warning): the rows are checked, the warnings are not the user's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found: dict[str, Tensor] = vmap(grad(pulled), in_dims=(None, 0, 0))(
            theta, lanes, list(ds.values()))
    return [found[n] for n in names]


def _fixed_state(module: nn.Module, params: list[Tensor]) -> dict[str, Tensor]:
    """What the vectorised call holds fixed: copies of the module's buffers (a forward that
    updates its state, like spectral norm's power iteration, updates these, not the module's,
    which the step's forward already moved) and its other parameters (those of covered layers
    inside it) detached, so that the rows are values with no graph back to them."""
    mine = {id(p) for p in params}
    fixed = {n: p.detach() for n, p in module.named_parameters() if id(p) not in mine}
    fixed.update({n: b.clone() for n, b in module.named_buffers()})
    return fixed


def _adds_up(rows: list[Tensor], params: list[Tensor], outputs: list[Tensor | Recorded],
             ds: dict[int, Tensor], k: int) -> bool:
    """Whether the rows add up to the recorded call's gradient, to a rounding bound."""
    summed = [d.reshape(-1, k, *d.shape[1:]).sum(1) for d in ds.values()]
    whole = torch.autograd.grad([edge_of(outputs[j]) for j in ds], params, summed,
                                retain_graph=True, allow_unused=True)
    for r, w, p in zip(rows, whole, params):
        w = torch.zeros_like(p) if w is None else w
        eps = torch.finfo(r.dtype).eps
        scale = float(r.reshape(r.shape[0], -1).norm(dim=1).sum()) + float(w.norm())
        gap = float((r.sum(0).double() - w.double()).norm())
        if not gap <= 256 * eps * scale:  # NaN too: a sample alone may not be defined
            return False
    return True


def _masked(params: list[Tensor], outputs: list[Tensor | Recorded], ds: dict[int, Tensor],
            k: int) -> list[Tensor]:
    """Route 2: batched vector-Jacobian products of the recorded outputs, one lane per
    objective, ``Dᵢₖ`` on sample i's rows; ``[B·K, *shape]`` per parameter."""
    lanes = next(iter(ds.values())).shape[0]
    width = max(max(outputs[j].shape.numel() for j in ds), 1)
    step = max(1, MASKED_ELEMENTS // width)
    parts: list[list[Tensor]] = []
    for start in range(0, lanes, step):
        rows = torch.arange(start, min(start + step, lanes))
        sample = torch.div(rows, k, rounding_mode="floor")
        masked = []
        for j, d in ds.items():
            go = d.new_zeros(len(rows), *outputs[j].shape)
            go[torch.arange(len(rows)), sample] = d[rows]
            masked.append(go)
        parts.append(_batched_vjp([edge_of(outputs[j]) for j in ds], params, masked))
    return [torch.cat([part[i] for part in parts]) for i in range(len(params))]


def _batched_vjp(edges: list[Any], params: list[Tensor], masked: list[Tensor]) -> list[Tensor]:
    """``∂(Σⱼ go[l]ⱼ·yⱼ)/∂θ`` for every lane l, ``[lanes, *shape]`` per parameter (lane by lane
    where a backward op cannot be batched)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*performance drop.*")
            got = torch.autograd.grad(edges, params, masked, retain_graph=True,
                                      allow_unused=True, is_grads_batched=True)
        return [torch.zeros(masked[0].shape[0], *p.shape, dtype=p.dtype, device=p.device)
                if g is None else g for g, p in zip(got, params)]
    except RuntimeError as error:
        if raised_by_model(error):  # a hook's own error: plain backward raises it too
            raise
        lanes = [torch.autograd.grad(edges, params, [m[lane] for m in masked],
                                     retain_graph=True, allow_unused=True)
                 for lane in range(masked[0].shape[0])]
        return [torch.stack([torch.zeros_like(p) if g[i] is None else g[i] for g in lanes])
                for i, p in enumerate(params)]
