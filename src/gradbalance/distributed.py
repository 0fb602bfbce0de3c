"""Data-parallel training: the task gradients are averaged over the ranks before balancing.

Under data parallelism each rank holds ``G_r`` ``[K, P]``, the task gradients of its own shard
of the batch. The full-batch task gradients are their mean, ``G = (1/n) Σ_r G_r`` (every loss
is a batch mean and every rank has the same number of samples). :class:`TaskGradBuffer`
therefore all-reduces, in ``apply_`` and before unscaling, clipping and balancing:

* ``G`` itself: one collective over the contiguous ``[K, P]`` buffer (the ideal bucket);
* one small bucket holding the heads' ``.grad`` (flattened) and the ``K`` losses;
* after the Gramian of the mean, one flag (``found_inf``), so that every rank skips the same
  steps under a ``GradScaler`` and no balancer changes its state on one rank only.

Balancing the mean is not the same as averaging balanced per-rank gradients (balancers are
not linear: docs/loop.md, "Micro-batches"), and the Gramian of the mean is not the mean of the
Gramians: the reduction happens on ``G``, never after the combine.

Cost: a plain data-parallel step all-reduces ``P + H`` numbers; the balanced step all-reduces
``K·P + H + K + 1``, i.e. about K× the gradient traffic, in two collectives (plus one of a
single element) instead of DDP's ~25 MB buckets.

``DistributedDataParallel``: run the forward and ``buf.backward`` inside ``model.no_sync()``
(:func:`ddp_no_sync`). K task gradients through ``autograd.grad`` never reach DDP's reducer,
and K ``backward`` calls would synchronise only the first one; the buffer does the whole
reduction itself.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from .weighting import LossWeighting

__all__ = [
    "LOCAL",
    "all_reduce_grads_",
    "all_reduce_mean_",
    "assert_same_across_ranks",
    "broadcast_generator_",
    "broadcast_parameters_",
    "ddp_no_sync",
    "sync_weighting_",
]

#: Pass ``process_group=LOCAL`` to a :class:`TaskGradBuffer` to turn the reduction off.
LOCAL = "local"


def resolve_process_group(process_group: Any = None) -> Any:
    """The group to reduce over, or None when there is nothing to do.

    ``None`` means the default (world) group when ``torch.distributed`` is initialised; the
    result is None without an initialised process group, for a group of one rank, or for
    ``"local"`` (reduction turned off on purpose).
    """
    if isinstance(process_group, str):
        if process_group != LOCAL:
            raise ValueError(
                f"Invalid process_group: {process_group!r} (expected a ProcessGroup, None for "
                f"the default group, or 'local' to turn the all-reduce off)"
            )
        return None
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError(
                f"Invalid process_group: {process_group!r} given but torch.distributed is not "
                f"initialised; call torch.distributed.init_process_group first"
            )
        return None
    group = dist.group.WORLD if process_group is None else process_group
    if dist.get_world_size(group) == 1:
        return None
    return group


def _comm_device(group: Any, device: torch.device) -> torch.device:
    """NCCL reduces CUDA tensors only; other backends take tensors where they are."""
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _launch_mean(tensors: Sequence[Tensor], group: Any) -> list[tuple[Any, Tensor, list[Tensor]]]:
    """Start one async SUM all-reduce per (device, dtype) bucket of ``tensors``."""
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    pending = []
    for (device, _), members in buckets.items():
        if len(members) == 1 and members[0].is_contiguous():
            flat = members[0].view(-1)
        else:
            flat = torch.cat([m.reshape(-1) for m in members])
        flat = flat.to(_comm_device(group, device))
        work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True)
        pending.append((work, flat, members))
    return pending


def _finish_mean(pending: list[tuple[Any, Tensor, list[Tensor]]], size: int) -> None:
    for work, flat, members in pending:
        work.wait()
        flat.div_(size)
        if len(members) == 1 and flat.data_ptr() == members[0].data_ptr():
            continue
        offset = 0
        for m in members:
            n = m.numel()
            m.copy_(flat[offset : offset + n].view_as(m))
            offset += n


def all_reduce_mean_(tensors: Sequence[Tensor], group: Any = None) -> None:
    """Replace every tensor by its mean over the ranks, in place, bucketed by dtype/device.

    Every rank must pass tensors of the same shapes, dtypes and order.
    """
    group = resolve_process_group(group)
    if group is None or not tensors:
        return
    _finish_mean(_launch_mean(tensors, group), dist.get_world_size(group))


def all_reduce_task_gradients_(matrix: Tensor, group: Any = None) -> Tensor:
    """``G ← (1/n) Σ_r G_r`` in place: one collective over the ``[K, P]`` buffer."""
    all_reduce_mean_([matrix], group)
    return matrix


def _grads_of(params: Iterable[Tensor]) -> list[Tensor]:
    grads = []
    for p in params:
        if p.grad is None:  # same layout on every rank: a missing gradient counts as zeros
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def all_reduce_grads_(params: Iterable[Tensor], group: Any = None) -> None:
    """Average ``.grad`` of ``params`` over the ranks in place, in one bucket per dtype.

    A missing ``.grad`` is treated as zeros (and materialised), so every rank reduces the
    same layout. Use it for parameters outside the buffer (e.g. a loss weighting's own).
    """
    all_reduce_mean_(_grads_of(params), group)


def all_reduce_step_(
    matrix: Tensor, losses: Tensor, head_params: Sequence[Tensor], group: Any
) -> Tensor:
    """The reduction of one balanced step; returns the mean losses ``[K]`` (a new tensor).

    ``G`` goes in one collective, the heads' ``.grad`` and the losses share a second one;
    both are in flight together. ``group`` must already be resolved (not None).
    """
    size = dist.get_world_size(group)
    mean_losses = losses.detach().clone()
    pending = _launch_mean([matrix], group)
    pending += _launch_mean([*_grads_of(head_params), mean_losses], group)
    _finish_mean(pending, size)
    return mean_losses


def all_reduce_grads_and_losses_(
    params: Sequence[Tensor], losses: Tensor, group: Any
) -> Tensor:
    """Average ``.grad`` of ``params`` in place and return the mean losses, in one bucket.

    For a step that wrote its gradients by one weighted backward (cached weights,
    ``update_every``): ``Σₖ wₖ ∇Lₖ`` is linear, so the mean of the ranks' gradients equals
    the full-batch one. ``group`` must already be resolved (not None).
    """
    mean_losses = losses.detach().clone()
    _finish_mean(_launch_mean([*_grads_of(params), mean_losses], group),
                 dist.get_world_size(group))
    return mean_losses


def all_gather_columns(matrix: Tensor, group: Any, mode: str = "features") -> Tensor:
    """``[K, n]`` on every rank -> ``[K, W·n]``, the ranks' columns side by side in rank order.

    For ``features`` and ``gramian`` modes: each rank's per-sample quantities (feature
    gradients; layer inputs and output gradients) cover its own samples, so the full batch's
    are their concatenation. Every rank must hold the same ``n`` (the same shard size); a
    different one raises on every rank, naming ``mode``. ``group`` must be resolved.
    """
    size = dist.get_world_size(group)
    device = _comm_device(group, matrix.device)
    width = torch.tensor([matrix.shape[1]], dtype=torch.int64, device=device)
    widths = [torch.empty_like(width) for _ in range(size)]
    dist.all_gather(widths, width, group=group)
    found = [int(w) for w in widths]
    if len(set(found)) > 1:
        raise ValueError(
            f"{mode} mode under data parallelism needs the same number of samples on every "
            f"rank, found sizes {found} (samples x width per rank); give every rank the same "
            f"number of samples (DistributedSampler(drop_last=True))"
        )
    local = matrix.contiguous().to(device)
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=1).to(matrix.device)


def sync_weighting_(weighting: LossWeighting, group: Any = None) -> None:
    """Average a loss weighting's pending observation over the ranks; call before ``update``.

    A weighting learns from the step's losses (and GradNorm from its layer gradients), which
    each rank observed on its own shard; their mean is the full batch's. The tensors are the
    ones :meth:`~gradbalance.LossWeighting.pending_tensors` returns, averaged in place. After
    this call every rank updates the weighting from the same numbers, so its state stays
    identical. (FAMO's ``losses_after``: average it with :func:`all_reduce_mean_` before
    passing it.)
    """
    group = resolve_process_group(group)
    if group is None:
        return
    all_reduce_mean_(weighting.pending_tensors(), group)


def all_ranks_true(flag: Tensor, group: Any) -> Tensor:
    """A 0-d bool tensor, True only if ``flag`` is True on every rank (one MIN all-reduce)."""
    value = flag.to(device=_comm_device(group, flag.device), dtype=torch.int32).reshape(1)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return value[0].to(device=flag.device, dtype=torch.bool)


def broadcast_parameters_(params: Iterable[Tensor], src: int = 0, group: Any = None) -> None:
    """Copy the values of ``params`` from rank ``src`` to every rank (unwrapped models).

    ``DistributedDataParallel`` does this at construction; without it, call this once before
    training so that every rank starts from the same weights.
    """
    group = resolve_process_group(group)
    if group is None:
        return
    with torch.no_grad():
        for p in params:
            buf = p.data.to(_comm_device(group, p.device))
            dist.broadcast(buf, src=src, group=group)
            if buf.data_ptr() != p.data.data_ptr():
                p.data.copy_(buf)


def broadcast_generator_(generator: torch.Generator, src: int = 0, group: Any = None) -> None:
    """Give ``generator`` on every rank the state it has on rank ``src``.

    Balancers that draw random numbers (random task order, random weights) then draw the same
    numbers on every rank; seeding every rank with the same seed does the same.
    """
    group = resolve_process_group(group)
    if group is None:
        return
    state = generator.get_state()
    device = _comm_device(group, state.device)
    buf = state.to(device)
    dist.broadcast(buf, src=src, group=group)
    generator.set_state(buf.cpu())


def _digest(tensors: Iterable[Any]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if isinstance(t, Tensor):
            data = t.detach().cpu().contiguous()
            h.update(str((tuple(data.shape), data.dtype)).encode())
            h.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        else:
            h.update(repr(t).encode())
    return h.hexdigest()


def _flatten_state(obj: Any) -> Iterator[Any]:
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield key
            yield from _flatten_state(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _flatten_state(item)
    else:
        yield obj


def assert_same_across_ranks(obj: Any, group: Any = None, what: str = "state") -> None:
    """Raise ``RuntimeError`` unless ``obj`` is bit-identical on every rank.

    ``obj``: a tensor, a list of tensors (e.g. ``list(model.parameters())``) or a state dict
    (nested dicts/lists of tensors and numbers, e.g. ``balancer.state_dict()``). Costs one
    ``all_gather_object`` of a SHA-256 digest; meant for checks, not for every step.
    """
    group = resolve_process_group(group)
    if group is None:
        return
    digest = _digest(_flatten_state(obj))
    digests: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, digest, group=group)
    differing = [r for r, d in enumerate(digests) if d != digests[0]]
    if differing:
        raise RuntimeError(
            f"{what} differs between ranks: ranks {differing} differ from rank 0; draw random "
            f"numbers from generators seeded alike (broadcast_generator_), start from the same "
            f"weights (broadcast_parameters_) and reduce every gradient"
        )


def ddp_no_sync(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    """``model.no_sync()`` for a ``DistributedDataParallel`` model, else a null context.

    Wrap the forward pass and ``buf.backward`` (every micro-batch) in it: the buffer reduces
    the task gradients and the heads' gradients itself.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()
