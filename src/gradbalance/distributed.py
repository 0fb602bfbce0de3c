"""Data-parallel training: the task gradients ``G`` are averaged over the ranks before
balancing, never after the combine (docs/distributed.md)."""

from __future__ import annotations

import contextlib
import hashlib
import warnings
import weakref
import zlib
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._checks import GLOBAL_LOSSES_TAG, as_loss_vector, tensor_list
from ._sharding import is_dtensor

if TYPE_CHECKING:
    from .weighting import LossWeighting

__all__ = [
    "LOCAL", "RankAgreementError", "all_reduce_grads_", "all_reduce_mean_",
    "assert_same_across_ranks", "broadcast_generator_", "broadcast_parameters_", "ddp_no_sync",
    "gathered_parameters", "global_losses", "sync_weighting_",
]

#: Pass ``process_group=LOCAL`` to a :class:`TaskGradBuffer` to turn the reduction off.
LOCAL = "local"


def resolve_process_group(process_group: Any = None) -> Any:
    """The group to reduce over (None: the world group), or None when there is nothing to do:
    no initialised process group, a group of one rank, or ``"local"``."""
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


def _listed(ranks: list[int]) -> str:
    return str(ranks) if len(ranks) <= 8 else f"[{', '.join(map(str, ranks[:8]))}, ...]"


def check_mesh_group(params: Sequence[Tensor], process_group: Any) -> None:
    """Raise ``ValueError`` unless ``process_group`` (unresolved) spans the mesh of a sharded
    trunk's ``params``: both must average over the same batch (docs/distributed.md)."""
    if not params or not is_dtensor(params[0]):
        return
    group = resolve_process_group(process_group)
    mesh: Any = params[0].device_mesh  # type: ignore[attr-defined]
    mesh_ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if group is None and len(mesh_ranks) == 1:
        return
    group_ranks = [] if group is None else sorted(dist.get_process_group_ranks(group))
    if mesh_ranks == group_ranks:
        return
    found = ("process_group='local' (or a one-rank group) reduces over no ranks" if group is None
             else f"process_group spans ranks {_listed(group_ranks)}")
    raise ValueError(
        f"{found} but the trunk is sharded over a mesh of ranks "
        f"{_listed(mesh_ranks)}: the losses and heads would be averaged over other ranks than the "
        f"trunk. Pass TaskGradBuffer(process_group=...) the group of the trunk's whole mesh "
        f"(the default world group when the mesh spans the world; mesh.get_group() for a 1-D "
        f"mesh over a subgroup)"
    )


def _comm_device(group: Any, device: torch.device) -> torch.device:
    """NCCL reduces CUDA tensors only; other backends take tensors where they are."""
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return device


class RankAgreementError(RuntimeError):
    """The ranks of a data-parallel step disagree, or one of them did not arrive in time.

    Raised on every rank before anything the user owns changes (docs/distributed.md, "When
    ranks disagree", "Stalls and timeouts").

    Example:
        >>> from gradbalance.distributed import RankAgreementError
        >>> issubclass(RankAgreementError, RuntimeError)  # caught by ``except RuntimeError``
        True
    """


def class_name(obj: object) -> str:
    """``obj``'s class name as :func:`check_step_agreement` compares it (``"None"`` for
    None)."""
    return "None" if obj is None else type(obj).__name__


def _code(name: str) -> int:
    """A number every rank computes alike for ``name`` (a mode, a dtype)."""
    return zlib.crc32(name.encode())


_DTYPE_NAMES = ("torch.float16", "torch.bfloat16", "torch.float32", "torch.float64")


def _name_of(code: int, local: str, known: Sequence[str]) -> str:
    """The name (this rank's, one of ``known``, a dtype) whose code is ``code``."""
    for name in (local, *known, "None", *_DTYPE_NAMES):
        if _code(name) == code:
            return name
    return f"<unknown, code {code}>"


def _who(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


_PLURAL = {"has": "have", "is": "are", "reuses": "reuse", "recomputes": "recompute",
           "passes": "pass", "applies": "apply"}


def _disagreement(phrases: list[str]) -> str:
    """``"rank 1 has K=3 tasks, rank 0 has K=2 tasks"`` from each rank's phrase, rank 0 last."""
    groups: dict[str, list[int]] = {}
    for rank, phrase in enumerate(phrases):
        groups.setdefault(phrase, []).append(rank)
    parts = []
    for phrase, ranks in sorted(groups.items(), key=lambda item: (item[1][0] == 0, item[1])):
        verb, _, rest = phrase.partition(" ")
        parts.append(f"{_who(ranks)} {_PLURAL.get(verb, verb) if len(ranks) > 1 else verb} {rest}")
    return ", ".join(parts)


def _gather_ints(values: list[int], group: Any, what: str) -> list[list[int]]:
    """Every rank's ``values`` (one all-gather of int64s); a stalled or crashed rank raises
    :class:`RankAgreementError` within the group's timeout."""
    local = torch.tensor(values, dtype=torch.int64,
                         device=_comm_device(group, torch.device("cpu")))
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    try:
        dist.all_gather(parts, local, group=group)
        return [part.tolist() for part in parts]
    except RuntimeError as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise RankAgreementError(
            f"{what} on rank {dist.get_rank(group)}: the other ranks did not reach the same "
            f"step ({type(error).__name__}: {first_line}). A rank stalled, crashed or "
            f"stopped calling {what} (it left the loop early or skipped a step); the wait "
            f"is bounded by the process group's timeout, "
            f"init_process_group(timeout=datetime.timedelta(...)). Nothing was reduced or "
            f"written on this rank"
        ) from error


#: What ``apply_`` compares across the ranks: how a value reads on a rank, and the fix.
_STEP_FIELDS: dict[str, tuple[str, str]] = {
    "num_tasks": ("has K={} tasks", "every rank must pass the same K losses to backward()"),
    "shared": ("has P={} shared parameter values",
               "build the same trunk (shared_params) on every rank"),
    "heads": ("has {} head parameter values", "build the same heads (head_params) on every rank"),
    "dtype": ("has a {} trunk", "give the trunk the same dtype on every rank"),
    "mode": ("has mode='{}'", "build every rank's TaskGradBuffer with the same mode"),
    "update_every": ("has update_every={}",
                     "build every rank's TaskGradBuffer with the same update_every"),
    "step": ("is at step {}",
             "a rank skipped apply_() (it began a step with backward() and dropped it, or "
             "called reset()) or resumed from another checkpoint; every rank must run every "
             "step"),
    "balancer": ("applies {}", "pass the same balancer class to apply_() on every rank"),
    "clip": ("clips with {}", "pass the same clip= (or none) to apply_() on every rank"),
    "scaled": ("{}", "pass an enabled GradScaler to backward() and apply_() on every rank or "
               "on none (an unscaled rank's gradients would be averaged with scaled ones)"),
    "masked": ("passes active={}", "pass active= on every rank or on none (the masks are "
               "combined: a task active on any rank is active)"),
    "count": ("has {} backward() call(s) in this step",
              "a rank skipped apply_() (its backward() calls then add up into the next step) "
              "or runs another number of micro-batches; every rank must call backward() as "
              "often and apply_() every step"),
    "reused": ("{}", "the ranks' update_every schedules differ (a rank skipped a step or "
               "resumed from another checkpoint)"),
}


#: The fields a mode counts in its own way (the per-sample step's micro-batches and steps):
#: not named where the ranks' modes differ.
_COUNTERS = ("step", "count", "reused")


def _reads(key: str, value: int, names: dict[str, str], modes: Sequence[str]) -> str:
    """How ``value`` of field ``key`` reads (``names``: this rank's mode and dtype)."""
    if key == "reused":
        return "reuses cached weights (update_every)" if value else "recomputes the weights"
    if key == "masked":
        return _STEP_FIELDS[key][0].format("<a mask>" if value else "None")
    if key == "scaled":
        return "scales its losses with a GradScaler" if value else "has no GradScaler"
    shown: object = _name_of(value, names[key], modes) if key in names else value
    return _STEP_FIELDS[key][0].format(shown)


def combined_mask(active: Tensor, group: Any) -> Tensor:
    """``active`` (a bool ``[K]`` mask) OR-ed over the ranks of ``group``: a task labelled on
    any rank's shard is active in the global batch (one all-reduce of ``K`` bytes)."""
    mask = active.to(torch.uint8)
    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
    return mask.bool()


def check_step_agreement(
    group: Any,
    *,
    num_tasks: int,
    shared: Sequence[Tensor],
    heads: Sequence[Tensor],
    mode: str,
    update_every: int,
    step: int,
    count: int,
    reused: bool,
    modes: Sequence[str] = (),
    balancer: str = "",
    masked: bool = False,
    clip: str = "None",
    scaled: bool = False,
) -> None:
    """Raise :class:`RankAgreementError` on every rank unless all run the same step (one
    all-gather of thirteen int64s); ``modes`` names another rank's mode in the error,
    ``balancer`` is the balancer's class name and ``clip`` the clipper's (``"None"``
    without; another rank's named where it is one of ``modes``: the caller passes the
    registered classes' names), ``masked`` whether ``active=`` was given, ``scaled`` whether
    the step's losses were scaled by an enabled ``GradScaler``."""
    dtype = str(shared[0].dtype) if shared else ""
    local = {
        "num_tasks": num_tasks,
        "shared": sum(p.numel() for p in shared),
        "heads": sum(p.numel() for p in heads),
        "dtype": _code(dtype),
        "mode": _code(mode),
        "update_every": update_every,
        "step": step,
        "balancer": _code(balancer),
        "clip": _code(clip),
        "scaled": int(scaled),
        "masked": int(masked),
        "count": count,
        "reused": int(reused),
    }
    names = {"dtype": dtype, "mode": mode, "balancer": balancer, "clip": clip}
    rows = _gather_ints(list(local.values()), group, "TaskGradBuffer.apply_()")
    problems = []
    at = list(local).index("mode")
    modes_differ = len({row[at] for row in rows}) > 1  # then the counters count other things
    for i, key in enumerate(local):
        column = [row[i] for row in rows]
        if len(set(column)) > 1 and not (modes_differ and key in _COUNTERS):
            text = _disagreement([_reads(key, value, names, modes) for value in column])
            problems.append(f"{text}: {_STEP_FIELDS[key][1]}")
    if problems:
        raise RankAgreementError(
            "TaskGradBuffer.apply_(): the ranks disagree, so their collectives would not "
            "pair; nothing was reduced or written.\n  - " + "\n  - ".join(problems)
        )


def check_same_layout(tensors: Sequence[Tensor], group: Any, what: str) -> None:
    """Raise :class:`RankAgreementError` on every rank unless all pass tensors of the same
    number, shapes and dtypes (one all-gather of three int64s). ``group``: resolved."""
    layout = repr([(tuple(t.shape), str(t.dtype)) for t in tensors])
    local = [len(tensors), sum(t.numel() for t in tensors), _code(layout)]
    rows = _gather_ints(local, group, what)
    if all(row == rows[0] for row in rows):
        return
    same_sizes = all(row[:2] == rows[0][:2] for row in rows)
    phrases = [f"passes {n} tensor(s) ({numel} values)"
               + (" of other shapes or dtypes" if same_sizes and digest != rows[0][2] else "")
               for n, numel, digest in rows]
    raise RankAgreementError(
        f"{what}: the ranks pass different tensors, so their collectives would not pair; "
        f"nothing was averaged or copied. {_disagreement(phrases)}: pass the same "
        f"parameters (or the same kind of object) on every rank, in the same order"
    )


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
    """Replace every tensor by its mean over the ranks, in place, bucketed by dtype/device
    (unchecked: every rank must pass tensors of the same shapes, dtypes and order).

    Example:
        >>> import torch
        >>> from gradbalance.distributed import all_reduce_mean_
        >>> t = torch.tensor([1.0, 3.0])
        >>> all_reduce_mean_([t])  # one process: the mean over one rank is the tensor itself
        >>> t
        tensor([1., 3.])
    """
    group = resolve_process_group(group)
    if group is None or not tensors:
        return
    _finish_mean(_launch_mean(tensors, group), dist.get_world_size(group))


def _grads_of(params: Iterable[Tensor]) -> list[Tensor]:
    grads = []
    for p in tensor_list("params", params):
        if p.grad is None:  # same layout on every rank: a missing gradient counts as zeros
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def all_reduce_grads_(params: Iterable[Tensor], group: Any = None) -> None:
    """Average ``.grad`` of ``params`` (outside the buffer) over the ranks, in place.

    A missing ``.grad`` counts as zeros (and is materialised). Parameters of other shapes on
    another rank raise :class:`RankAgreementError` on every rank before any ``.grad`` changes.

    Example:
        >>> import torch
        >>> from gradbalance.distributed import all_reduce_grads_
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> all_reduce_grads_([w])  # one process: nothing to average
        >>> w.grad  # the missing gradient counts as zeros, and is materialised
        tensor([0., 0.])
    """
    listed = list(params)
    group = resolve_process_group(group)
    if group is not None:
        check_same_layout(listed, group, "all_reduce_grads_()")
    grads = _grads_of(listed)
    if group is not None:
        all_reduce_mean_(grads, group)


def all_reduce_grads_and_losses_(
    params: Sequence[Tensor], losses: Tensor, group: Any, matrix: Tensor | None = None,
    also: Sequence[Tensor] = (),
) -> Tensor:
    """Average ``.grad`` of ``params`` and ``also`` in place and return the mean losses, in one
    bucket; with ``matrix`` (a step's ``G``), ``G`` too, in a second collective. ``group``:
    resolved."""
    mean_losses = losses.detach().clone()
    pending = [] if matrix is None else _launch_mean([matrix], group)
    pending += _launch_mean([*also, *_grads_of(params), mean_losses], group)
    _finish_mean(pending, dist.get_world_size(group))
    return mean_losses


def all_gather_columns(matrix: Tensor, group: Any, mode: str = "features") -> Tensor:
    """``[K, n]`` on every rank -> ``[K, W·n]``, the ranks' columns side by side in rank order;
    another ``n`` on some rank raises on every rank, naming ``mode``. ``group``: resolved."""
    found = [row[0] for row in _gather_ints([matrix.shape[1]], group,
                                            f"TaskGradBuffer.apply_() ({mode} mode)")]
    if len(set(found)) > 1:
        raise ValueError(
            f"{mode} mode under data parallelism needs the same number of samples on every "
            f"rank, found sizes {found} (samples x width per rank); give every rank the same "
            f"number of samples (DistributedSampler(drop_last=True))"
        )
    local = matrix.contiguous().to(_comm_device(group, matrix.device))
    parts = [torch.empty_like(local) for _ in range(len(found))]
    dist.all_gather(parts, local, group=group)
    return torch.cat(parts, dim=1).to(matrix.device)


def sync_weighting_(weighting: LossWeighting, group: Any = None) -> None:
    """Average a loss weighting's :meth:`~gradbalance.LossWeighting.pending_tensors` over the
    ranks, in place; call before ``update``.

    Example:
        >>> import torch
        >>> from gradbalance import sync_weighting_
        >>> from gradbalance.weighting import DWA
        >>> weighting = DWA(num_tasks=2)
        >>> _ = weighting(torch.tensor([2.0, 4.0], requires_grad=True))  # the step's losses
        >>> sync_weighting_(weighting)  # one process: the pending losses stay as they are
        >>> weighting.pending_tensors()
        [tensor([2., 4.], dtype=torch.float64)]
    """
    group = resolve_process_group(group)
    if group is None:
        return
    pending = weighting.pending_tensors()
    check_same_layout(pending, group, f"sync_weighting_({type(weighting).__name__})")
    all_reduce_mean_(pending, group)


class _GlobalValues(torch.autograd.Function):
    """The values of ``mean`` with the gradient of ``local`` (the identity to it)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, mean: Tensor) -> Tensor:
        return mean.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def global_losses(losses: Tensor | Sequence[Tensor], group: Any = None) -> Tensor:
    """The K task losses ``[K]`` with the values of the global batch's (their mean over the
    ranks, averaged in float64) and the gradient of this rank's: ``∂/∂θ f(global_losses(L))
    = Σₖ ∂f/∂Lₖ(L̄) ∇Lₖ``, which the data-parallel average of the ranks' gradients makes the
    single-process gradient on the global batch ``Σₖ ∂f/∂Lₖ(L̄) ∇L̄ₖ`` for any weighting
    ``f``. GLS, ScaleInvariant, STCH and FAMO weight the losses by their values in the call:
    pass them these (the integrations do; docs/distributed.md). Without a process group (or
    with one rank) the losses as one vector; raises :class:`RankAgreementError` on every
    rank when the ranks pass different numbers of losses.

    Example:
        >>> import torch
        >>> from gradbalance.distributed import global_losses
        >>> from gradbalance.weighting import GLS
        >>> losses = torch.tensor([1.0, 4.0], requires_grad=True)
        >>> GLS(2)(global_losses(losses))  # one process: the losses as they are
        tensor([1., 1.], grad_fn=<MulBackward0>)
    """
    vector = as_loss_vector("losses", losses)
    group = resolve_process_group(group)
    if group is None:
        return vector
    check_same_layout([vector], group, "global_losses")
    mean = vector.detach().to(torch.float64).clone()
    all_reduce_mean_([mean], group)
    out: Tensor = _GlobalValues.apply(vector, mean.to(vector.dtype))  # type: ignore[no-untyped-call]
    setattr(out, GLOBAL_LOSSES_TAG, True)
    return out


def all_ranks_true(flag: Tensor, group: Any) -> Tensor:
    """``flag`` (bool, any shape) True only where it is True on every rank (one MIN all-reduce)."""
    value = flag.to(device=_comm_device(group, flag.device), dtype=torch.int32).reshape(-1)
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=group)
    return value.reshape(flag.shape).to(device=flag.device, dtype=torch.bool)


def broadcast_parameters_(params: Iterable[Tensor], src: int = 0, group: Any = None) -> None:
    """Copy the values of ``params`` from rank ``src`` to every rank; call once before training
    an unwrapped model (``DistributedDataParallel`` does it at construction).

    Example:
        >>> import torch
        >>> from gradbalance import broadcast_parameters_
        >>> model = torch.nn.Linear(2, 1)
        >>> before = model.weight.clone()
        >>> broadcast_parameters_(model.parameters())  # one process: nothing to copy
        >>> torch.equal(model.weight, before)
        True
    """
    group = resolve_process_group(group)
    if group is None:
        return
    listed = list(params)
    check_same_layout(listed, group, "broadcast_parameters_()")
    with torch.no_grad():
        for p in listed:
            buf = _broadcast(p.data, src, group)
            if buf.data_ptr() != p.data.data_ptr():
                p.data.copy_(buf)


def _broadcast(tensor: Tensor, src: int, group: Any) -> Tensor:
    """Rank ``src``'s ``tensor`` (in place where the backend takes it where it is)."""
    buf = tensor.to(_comm_device(group, tensor.device))
    dist.broadcast(buf, src=src, group=group)
    return buf


def broadcast_generator_(generator: torch.Generator, src: int = 0, group: Any = None) -> None:
    """Give ``generator`` on every rank the state it has on rank ``src`` (so that a balancer
    draws the same random numbers on every rank).

    Example:
        >>> import torch
        >>> from gradbalance import broadcast_generator_
        >>> generator = torch.Generator().manual_seed(0)
        >>> broadcast_generator_(generator)  # one process: rank 0's state is already its own
        >>> torch.equal(generator.get_state(), torch.Generator().manual_seed(0).get_state())
        True
    """
    group = resolve_process_group(group)
    if group is None:
        return
    generator.set_state(_broadcast(generator.get_state(), src, group).cpu())


def _digest(tensors: Iterable[Any]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if isinstance(t, Tensor):
            data = t.detach().cpu().contiguous()
            h.update(str((tuple(data.shape), data.dtype)).encode())
            h.update(data.reshape(-1).view(torch.uint8).numpy().tobytes() if data.numel()
                     else b"")  # reshaped: a 0-d tensor cannot be viewed as bytes
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
    """Raise ``RuntimeError`` unless ``obj`` (a tensor, a list of tensors, a state dict) is
    bit-identical on every rank: one ``all_gather_object`` of a SHA-256 digest, a debugging aid.

    Example:
        >>> import torch
        >>> from gradbalance import assert_same_across_ranks
        >>> model = torch.nn.Linear(2, 1)
        >>> assert_same_across_ranks(model.state_dict(), what="weights")  # one process: passes
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
    """``model.no_sync()`` for a ``DistributedDataParallel`` model, else a null context; wrap
    the forward and every ``buf.backward`` in it (the buffer reduces the gradients itself).

    Example:
        >>> import torch
        >>> from gradbalance import ddp_no_sync
        >>> model = torch.nn.Linear(2, 1)
        >>> with ddp_no_sync(model):  # a plain module: a null context
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> model.bias.grad
        tensor([1.])
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        _warn_comm_hooks(model)
        return model.no_sync()
    return contextlib.nullcontext()


#: The DDP models whose communication hook :func:`ddp_no_sync` has named (the user's model
#: itself is not written to).
_WARNED_COMM_HOOKS: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _warn_comm_hooks(model: nn.Module) -> None:
    """Warn, once per model, where DDP has a communication hook: the buffer averages the
    gradients with its own all-reduce, which the hook (compression, PowerSGD) does not see."""
    hooks = getattr(model, "_comm_hooks", None)
    if not hooks or model in _WARNED_COMM_HOOKS:
        return
    _WARNED_COMM_HOOKS.add(model)
    names = [getattr(hook, "__name__", type(hook).__name__) for hook, _ in hooks]
    warnings.warn(
        f"the DistributedDataParallel model has a communication hook ({', '.join(names)}): "
        f"under ddp_no_sync the buffer averages the task gradients with its own all-reduce "
        f"in their dtype, so the hook does not run on the balanced step "
        f"(docs/distributed.md, \"What TaskGradBuffer does\")",
        UserWarning, stacklevel=3)


def gathered_parameters(module: nn.Module) -> list[Tensor]:
    """The parameters FSDP2 computes ``module``'s forward with, its all-gathered copies, which
    ``autograd.grad`` can target (docs/distributed.md, "Sharded trunks"); call it once, after
    ``fully_shard``.

    Example:
        >>> import torch
        >>> from gradbalance.distributed import gathered_parameters
        >>> layer = torch.nn.Linear(2, 1)  # not under fully_shard: its own parameters
        >>> [p is q for p, q in zip(gathered_parameters(layer), layer.parameters())]
        [True, True]
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    from torch.distributed.fsdp import FSDPModule

    params: list[Tensor]
    if isinstance(module, FSDPModule):
        module.unshard()
        try:
            params = list(module.parameters())
        finally:
            module.reshard()
    else:
        params = list(module.parameters())
    sharded = [tuple(p.shape) for p in params if is_dtensor(p)]
    if sharded:
        raise ValueError(
            f"{type(module).__name__} has parameters sharded by an enclosing fully_shard (shapes "
            f"{sharded[:3]}): their gathered copies belong to that module's group. Wrap this "
            f"layer with fully_shard itself (before its parent) and pass it"
        )
    return params
