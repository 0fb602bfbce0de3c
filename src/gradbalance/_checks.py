"""Every argument check of the package, in one house style (docs/ARCHITECTURE.md, "Modules"):
``check_<what>(name, value, ...)`` returns the value, ``as_<what>`` the converted one, and a
message names the argument, the value found and what to pass: ``Invalid beta: 1.5 (expected
0.0 <= beta < 1.0)``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

#: The one refusal of losses with no graph (the task route's and the per-sample route's).
LOSSES_WITHOUT_GRAD = (
    "losses do not require grad; compute them from the model's outputs with grad enabled "
    "(not under torch.no_grad() or from detached tensors)"
)


def _in_range(value: float, low: float | None, high: float | None, low_open: bool,
              high_open: bool) -> bool:
    """``value`` within ``[low, high]`` (open ends on request; None: unbounded)."""
    if low is not None and not (value > low if low_open else value >= low):
        return False
    return high is None or (value < high if high_open else value <= high)


def _range_text(name: str, low: float | None, high: float | None, low_open: bool = False,
                high_open: bool = False) -> str:
    """The expected range as written in a message, e.g. ``0.0 <= beta < 1.0``."""
    left = "" if low is None else f"{low} {'<' if low_open else '<='} "
    right = "" if high is None else f" {'<' if high_open else '<='} {high}"
    return f"{left}{name}{right}"


def check_range(name: str, value: float, low: float | None, high: float | None,
                low_open: bool = False, high_open: bool = False) -> float:
    """A finite float in ``[low, high]`` (open ends on request; None: unbounded above or
    below, by any finite number: an infinite hyperparameter gave NaN updates)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and value == value  # not NaN
    if not (ok and _in_range(value, low, high, low_open, high_open)):
        raise ValueError(f"Invalid {name}: {value!r} (expected "
                         f"{_range_text(name, low, high, low_open, high_open)})")
    if not math.isfinite(value):
        raise ValueError(f"Invalid {name}: {value!r} (expected a finite number, "
                         f"{_range_text(name, low, high, low_open, high_open)})")
    return float(value)


def check_positive(name: str, value: float, allow_zero: bool = False, hint: str = "") -> float:
    """A finite number ``> 0`` (``>= 0`` with ``allow_zero``); ``hint`` ends the message."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if ok:
        ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"Invalid {name}: {value!r} (expected a finite number {bound}{hint})")
    return float(value)


def check_int(name: str, value: int, low: int, hint: str = "") -> int:
    """An int ``>= low`` (not a bool); ``hint`` ends the message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"Invalid {name}: {value!r} (expected an int >= {low}{hint})")
    return value


def check_optional_int(name: str, value: int | None, low: int,
                       hint: str = " or None") -> int | None:
    """None, or an int ``>= low`` (:func:`check_int`)."""
    return None if value is None else check_int(name, value, low, hint)


def check_positive_int(name: str, value: int, hint: str = "", high: int | None = None) -> int:
    """A positive int (not a bool), at most ``high`` where given; ``hint`` ends the
    message."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or (
            high is not None and value > high):
        most = "" if high is None else f" <= {high}"
        raise ValueError(f"Invalid {name}: {value!r} (expected a positive int{most}{hint})")
    return value


#: The most tasks a setting takes (a tensor dimension: ``K`` past it overflowed in torch).
MAX_TASKS = 2**31 - 1


def check_num_tasks(name: str, value: int) -> int:
    """The number of tasks ``K`` given at construction."""
    return check_positive_int(name, value, ", the number of tasks K", MAX_TASKS)


def check_optional_num_tasks(name: str, value: int | None) -> int | None:
    """None (inferred later) or the number of tasks ``K`` (:func:`check_num_tasks`)."""
    return None if value is None else check_positive_int(
        name, value, ", the number of tasks K, or None to infer it", MAX_TASKS)


def check_norm_type(name: str, value: float) -> float:
    """The ``p`` of a p-norm: a number ``>= 1``, ``float('inf')`` included."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
        raise ValueError(f"Invalid {name}: {value!r} (expected a number >= 1 or float('inf'))")
    return float(value)


def check_bool(name: str, value: bool) -> bool:
    """``True`` or ``False`` (no truthy stand-ins)."""
    if not isinstance(value, bool):
        raise ValueError(f"Invalid {name}: {value!r} (expected True or False)")
    return value


def check_batch_dim(value: object, or_none: bool = False) -> int:
    """``batch_dim``: the int 0 (the samples' dimension); not a bool, a float or another dim."""
    if isinstance(value, bool) or not isinstance(value, int) or value != 0:
        alternatives = " or None" if or_none else ""
        raise ValueError(f"batch_dim must be 0 (the samples' dimension){alternatives}, got "
                         f"{value!r}")
    return value


def check_choice(name: str, value: str, options: Sequence[str]) -> str:
    """One of ``options`` (a string: an array's ``in`` raised NumPy's ambiguity error)."""
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"Invalid {name}: {value!r} (expected one of {', '.join(options)})")
    return value


def check_generator(name: str, value: torch.Generator | None) -> torch.Generator | None:
    """``None`` (the method's default source) or a ``torch.Generator`` (a seed is refused)."""
    if value is not None and not isinstance(value, torch.Generator):
        seed = value if isinstance(value, int) and not isinstance(value, bool) else 0
        raise ValueError(
            f"Invalid {name}: {type(value).__name__} {value!r} (expected a torch.Generator or "
            f"None; for a seeded stream pass {name}=torch.Generator().manual_seed({seed}))"
        )
    return value


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters, for an error message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _all_within(vec: Tensor, low: float | None, high: float | None) -> bool:
    """Every entry finite and within ``[low, high]`` (None: unbounded)."""
    ok = bool(torch.isfinite(vec).all())
    if ok and low is not None:
        ok = bool((vec >= low).all())
    if ok and high is not None:
        ok = bool((vec <= high).all())
    return ok


def real_values(name: str, value: object) -> Tensor:
    """``value`` (numbers, a list of them or a real tensor) as a float64 CPU copy;
    ``ValueError`` naming ``name`` for anything else: a string, a complex tensor (its
    imaginary part was dropped), a bool one (read as 0/1), a tensor without data (``meta``)."""
    if isinstance(value, Tensor) and (value.is_complex() or value.dtype == torch.bool
                                      or value.device.type == "meta"):
        raise ValueError(f"Invalid {name}: a {value.dtype} tensor on {value.device} (expected "
                         f"real numbers)")
    try:
        probe = torch.as_tensor(value)  # its own dtype: complex or bool refused below
        out = (value.detach() if isinstance(value, Tensor)  # numbers straight to float64
               else torch.as_tensor(value, dtype=torch.float64))
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise ValueError(f"Invalid {name}: {short_repr(value)} (expected real numbers, e.g. a "
                         f"list of floats)") from None
    if probe.is_complex() or probe.dtype == torch.bool:
        raise ValueError(f"Invalid {name}: {short_repr(value)} (expected real numbers, not "
                         f"{probe.dtype})")
    if _holds_flag(value):  # ``[True, 2.0]``: torch reads the flag as 1.0
        raise ValueError(f"Invalid {name}: {short_repr(value)} (expected real numbers, not "
                         f"True/False among them)")
    return out.to(device="cpu", dtype=torch.float64, copy=True)


def check_device(name: str, value: object) -> torch.device:
    """``value`` (a ``torch.device``, a name such as ``"cpu"`` or ``"cuda:0"``, or a
    non-negative index) as a ``torch.device`` this process can allocate on; ``ValueError``
    naming ``name`` otherwise (a negative index, an unknown name, CUDA without a GPU)."""
    try:
        if isinstance(value, bool) or not isinstance(value, (torch.device, str, int)):
            raise TypeError
        device = torch.device(value)
        torch.empty(0, device=device)  # the device exists here
    except (TypeError, RuntimeError, AssertionError, ValueError) as error:
        why = "" if isinstance(error, TypeError) else f": {error}"
        raise ValueError(f"Invalid {name}: {short_repr(value)}{why} (expected a device this "
                         f"process can use, such as 'cpu', 'cuda:0' or a torch.device)") from None
    return device


def _holds_flag(value: object) -> bool:
    """Whether a (nested) list or tuple holds a bool (Python's, NumPy's or a bool tensor)."""
    if isinstance(value, (list, tuple)):
        return any(_holds_flag(item) for item in value)
    if isinstance(value, Tensor):
        return value.dtype == torch.bool
    return type(value).__name__ in ("bool", "bool_")


def as_task_vector(name: str, value: Sequence[float] | Tensor, num_tasks: int | None = None,
                   low: float | None = None, high: float | None = None) -> Tensor:
    """A per-task setting: one finite number per task ``[K]`` (float64 copy), optionally
    within ``[low, high]``; with ``num_tasks`` the length must be ``K``."""
    vec = real_values(name, value)
    if vec.dim() != 1 or vec.numel() == 0:
        raise ValueError(
            f"Invalid {name}: shape {tuple(vec.shape)} (expected a 1-D list of K numbers)"
        )
    if not _all_within(vec, low, high):
        bounded = low is not None or high is not None
        expected = _range_text(name, low, high) if bounded else "finite numbers"
        raise ValueError(f"Invalid {name}: {vec.tolist()} (expected {expected})")
    if num_tasks is not None and vec.numel() != num_tasks:
        raise ValueError(
            f"Invalid {name}: {vec.numel()} values but num_tasks={num_tasks} (expected one "
            f"per task)"
        )
    return vec


def as_pref(name: str, value: object) -> Tensor | None:
    """A preference vector given at construction (shape only; its length is checked per call)."""
    if value is None:
        return None
    vec = real_values(name, value).reshape(-1)
    if vec.numel() == 0 or not bool(torch.isfinite(vec).all()) or bool((vec < 0).any()):
        raise ValueError(f"Invalid {name}: {vec.tolist()} (expected K finite numbers >= 0)")
    return vec


def check_pref(name: str, value: Tensor | None, num_tasks: int, default: float) -> Tensor:
    """A preference vector ``[K]`` (float64, CPU, finite, non-negative); ``default`` if None."""
    if value is None:
        return torch.full((num_tasks,), default, dtype=torch.float64)
    if value.numel() != num_tasks:
        raise ValueError(
            f"Invalid {name}: {value.numel()} entries for {num_tasks} tasks (expected one entry "
            f"per task)"
        )
    vec = real_values(name, value).reshape(-1)
    if not bool(torch.isfinite(vec).all()) or bool((vec < 0).any()):
        raise ValueError(f"Invalid {name}: {vec.tolist()} (expected finite numbers >= 0)")
    return vec


def _loss_tensor(name: str, value: Tensor) -> Tensor:
    """A 1-D tensor of task losses, as given."""
    if value.dim() != 1 or value.numel() == 0:
        raise ValueError(
            f"{name} must be a 1-D tensor of K task losses, got shape "
            f"{tuple(value.shape)}; reduce each task loss to a scalar (e.g. the batch mean) "
            f"and pass torch.stack([loss_1, ..., loss_K])"
        )
    return value


def _stacked_losses(name: str, value: Sequence[Tensor]) -> Tensor:
    """A list/tuple of scalar tensors stacked into ``[K]``."""
    if len(value) == 0:
        raise ValueError(f"{name} is empty; pass one scalar loss per task")
    for k, loss in enumerate(value):
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            found = type(loss).__name__ if not isinstance(loss, Tensor) else tuple(loss.shape)
            raise ValueError(
                f"{name}[{k}] must be a scalar tensor, got {found}; reduce each task "
                f"loss to a scalar (e.g. reduction='mean')"
            )
    return torch.stack([loss.reshape(()) for loss in value])


#: The attribute :func:`~gradbalance.distributed.global_losses` sets on the tensor it
#: returns; the loss weightings that read the losses' values
#: (:attr:`~gradbalance.LossWeighting.reads_losses`) look for it under a process group.
GLOBAL_LOSSES_TAG = "_gradbalance_global_losses"
#: The attribute a loss weighting's call sets on the weighted losses it returns: a callable
#: that takes the call's losses back out of the weighting's pending observation. A buffer
#: that drops a step calls it for every micro-batch of the step (docs/loop.md, "When a step
#: fails"), so a retried step observes its losses once.
UNDO_OBSERVATION_TAG = "_gradbalance_undo_observation"


def as_loss_vector(name: str, value: Tensor | Sequence[Tensor],
                   num_tasks: int | None = None) -> Tensor:
    """The task losses (a 1-D tensor or a list of scalar tensors) as a 1-D tensor ``[K]`` that
    keeps the autograd graph."""
    if isinstance(value, Tensor):
        vector = _loss_tensor(name, value)
    elif isinstance(value, (list, tuple)):
        vector = _stacked_losses(name, value)
    else:
        raise ValueError(
            f"{name} must be a 1-D tensor or a list of scalar tensors, got "
            f"{type(value).__name__}"
        )
    if vector.is_complex() or vector.dtype == torch.bool:  # autograd's error came mid-step
        raise ValueError(
            f"{name} has dtype {vector.dtype}; task losses are real numbers (a complex loss: "
            f"take its real part or its abs())"
        )
    if num_tasks is not None and vector.numel() != num_tasks:
        raise ValueError(
            f"{name} has {vector.numel()} tasks but {num_tasks} were expected "
            f"(num_tasks or an earlier call); pass one loss per task, in the same order every call"
        )
    return vector


def task_value_vectors(*named: tuple[str, object]) -> list[Tensor]:
    """The per-task vectors of a functional weighting kernel, as float64 values (detached):
    each a 1-D real tensor (or list of numbers) of ``K ≥ 1`` entries, the same ``K`` (the
    first's) for all; the error names the argument, what it holds and the fix."""
    out: list[Tensor] = []
    for name, value in named:
        try:
            vec = torch.as_tensor(value).detach()
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"Invalid {name}: a {type(value).__name__} (expected a 1-D tensor "
                             f"of K numbers, one per task)") from None
        if vec.dim() != 1 or vec.numel() == 0 or vec.is_complex() or vec.dtype == torch.bool:
            raise ValueError(f"Invalid {name}: shape {tuple(vec.shape)}, dtype {vec.dtype} "
                             f"(expected a 1-D real tensor of K numbers, one per task)")
        if out and vec.numel() != out[0].numel():
            raise ValueError(f"{name} has {vec.numel()} entries but {named[0][0]} has "
                             f"{out[0].numel()}: pass one value per task to each")
        out.append(vec.to(torch.float64))
    return out


def check_nonnegative_losses(name: str, value: Tensor, method: str) -> Tensor:
    """Finite losses must be ``>= 0`` for ``method`` (inf/NaN pass: the step is skipped);
    one host sync."""
    finite = value.detach()[torch.isfinite(value.detach())]
    if bool((finite < 0).any()):
        raise ValueError(
            f"Invalid {name}: {value.detach().tolist()} ({method} expects every task loss "
            f">= 0, e.g. an MSE or a cross-entropy; shift or reformulate the loss)"
        )
    return value


def tensor_list(name: str, value: object) -> list[Tensor]:
    """``value`` (a tensor or an iterable of tensors, not a string or a mapping) as a list;
    ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, torch.nn.Module):  # a Sequential / ModuleList iterates its modules
        raise ValueError(f"Invalid {name}: a {type(value).__name__} module (expected its "
                         f"parameters: {name}=module.parameters())")
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ValueError(f"Invalid {name}: a {type(value).__name__} (expected a tensor or an "
                         f"iterable of them, e.g. model.parameters())")
    out = list(value)
    for i, item in enumerate(out):
        if not isinstance(item, Tensor):
            raise ValueError(f"{name}[{i}] is a {type(item).__name__}, expected a torch.Tensor")
    return out


def module_list(modules: object) -> list[torch.nn.Module]:
    """``modules`` (an ``nn.Module`` or an iterable of them, not a mapping or a string) as a
    list; ``ValueError`` naming the argument for anything else (every mode that takes it)."""
    if isinstance(modules, torch.nn.Module):
        return [modules]
    listed = isinstance(modules, Iterable) and not isinstance(modules, (str, bytes, dict))
    roots = list(modules) if listed else []  # type: ignore[call-overload]
    if not roots or not all(isinstance(m, torch.nn.Module) for m in roots):
        raise ValueError(
            f"Invalid modules: {modules!r} (expected an nn.Module or a list of them, "
            f"the trunk owning shared_params)"
        )
    return roots


def check_module(name: str, value: object) -> None:
    """An ``nn.Module`` (``TypeError`` naming ``name`` otherwise)."""
    if not isinstance(value, torch.nn.Module):
        raise TypeError(f"Invalid {name}: a {type(value).__name__} (expected an nn.Module)")


def as_parameter_list(name: str, value: Iterable[Tensor] | Tensor | None,
                      allow_empty: bool = False, leaf: bool = True) -> list[Tensor]:
    """Materialise a parameter iterable, rejecting tensors that require no grad and, with
    ``leaf``, tensors computed from others (their ``.grad`` is never filled)."""
    result = [] if value is None else tensor_list(name, value)
    if not result and not allow_empty:
        raise ValueError(
            f"{name} is empty; pass the parameters, e.g. {name}=model.trunk.parameters() "
            f"(a generator can be consumed only once: pass a list if you reuse it)"
        )
    seen: set[int] = set()
    for i, p in enumerate(result):
        if not p.requires_grad:
            raise ValueError(
                f"{name}[{i}] (shape {tuple(p.shape)}) does not require grad; leave frozen "
                f"parameters out of {name}, e.g. [p for p in params if p.requires_grad] (one "
                f"unfrozen later needs a new object that lists it)"
            )
        if leaf and not p.is_leaf:
            raise ValueError(
                f"{name}[{i}] (shape {tuple(p.shape)}) is not a leaf tensor: it is computed "
                f"from other tensors (e.g. w * 2, w.to(...), w[0]), so autograd never fills its "
                f".grad and no optimizer steps it; pass the parameters themselves, e.g. "
                f"{name}=model.parameters()"
            )
        if id(p) in seen:
            raise ValueError(f"{name}[{i}] appears twice in {name}; list each parameter once")
        seen.add(id(p))
    return result


ParamSignature = tuple[torch.Size, torch.dtype, torch.device]


def param_signatures(params: Sequence[Tensor]) -> list[ParamSignature]:
    """Shape, dtype and device of every parameter, for :func:`check_parameters_unchanged`."""
    return [(p.shape, p.dtype, p.device) for p in params]


def check_parameters_unchanged(name: str, params: Sequence[Tensor],
                               signatures: Sequence[ParamSignature]) -> None:
    """The parameters still require grad and keep the shape, dtype and device recorded when
    the object holding them was built (a frozen or moved parameter would fail half-way)."""
    for i, (p, (shape, dtype, device)) in enumerate(zip(params, signatures)):
        if not p.requires_grad:
            raise ValueError(
                f"{name}[{i}] (shape {tuple(p.shape)}) no longer requires grad (frozen after "
                f"the TaskGradBuffer was built); build a new buffer over the trainable "
                f"parameters, e.g. [p for p in params if p.requires_grad]"
            )
        if p.shape != shape or p.dtype != dtype or p.device != device:
            raise ValueError(
                f"{name}[{i}] changed from shape {tuple(shape)}, {dtype} on {device} to shape "
                f"{tuple(p.shape)}, {p.dtype} on {p.device} since the TaskGradBuffer was built; "
                f"build the buffer after the model's last .to(), resize or reload"
            )


def check_matrix(name: str, value: Tensor, num_tasks: int | None = None) -> Tensor:
    """A task-gradient matrix ``[K, P]`` (shape and dtype; finiteness is checked apart)."""
    if not isinstance(value, Tensor) or value.dim() != 2:
        found = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(
            f"{name} must be a 2-D tensor [K, P] of task gradients, got {found}; "
            f"stack one flattened gradient per task"
        )
    if value.shape[0] == 0:
        raise ValueError(f"{name} has no rows; pass at least one task gradient")
    if num_tasks is not None and value.shape[0] != num_tasks:
        raise ValueError(
            f"{name} has {value.shape[0]} task rows but the balancer was built with "
            f"num_tasks={num_tasks}; build it with the model's number of tasks"
        )
    if not value.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {value.dtype}")
    if value.device.type == "meta":
        raise ValueError(f"{name} is on the meta device (shapes only, no values); pass the "
                         f"task gradients themselves")
    return value


def check_square(name: str, value: object) -> Tensor:
    """A real floating ``[K, K]`` tensor (a Gramian); ``ValueError`` naming ``name``."""
    if not isinstance(value, Tensor):
        raise ValueError(f"Invalid {name}: a {type(value).__name__} (expected a [K, K] tensor, "
                         f"e.g. gradbalance.functional.compute_gramian(matrix))")
    if value.dim() != 2 or value.shape[0] != value.shape[1]:
        raise ValueError(f"{name} must be [K, K], got shape {tuple(value.shape)}")
    if value.shape[0] == 0:
        raise ValueError(f"{name} has no tasks; pass the Gramian of at least one task gradient")
    if not value.is_floating_point():
        raise ValueError(f"{name} must be floating point, got dtype {value.dtype}")
    return value


def check_loss_scale(name: str, value: object) -> float | Tensor:
    """A loss scale: a finite number ``> 0``, or a one-element real floating tensor (a
    ``GradScaler``'s scale, read without a host sync); ``ValueError`` otherwise."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or not value.is_floating_point():
            raise ValueError(f"Invalid {name}: a tensor of shape {tuple(value.shape)} and dtype "
                             f"{value.dtype} (expected one real number > 0, e.g. "
                             f"scaler.get_scale())")
        return value
    return check_positive(name, value, hint=", the factor the losses were multiplied by")  # type: ignore[arg-type]


def check_writable_rows(name: str, value: Tensor) -> Tensor:
    """A ``[K, P]`` matrix a row clipper scales in place (:func:`check_matrix`, then
    writable): not a tensor that requires grad, not an expanded view whose rows share memory
    (``ValueError``, before the clipper reads it)."""
    check_matrix(name, value)
    if value.requires_grad:
        raise ValueError(f"{name} requires grad, so it cannot be clipped in place; pass the "
                         f"task gradients detached (matrix.detach().clone())")
    if any(stride == 0 and size > 1 for stride, size in zip(value.stride(), value.shape)):
        raise ValueError(f"{name} is an expanded view (strides {tuple(value.stride())}), whose "
                         f"rows share memory, so it cannot be clipped row by row in place; "
                         f"pass matrix.contiguous()")
    return value


def check_generator_state(owner: str, state: object, device: torch.device | str = "cpu") -> Tensor:
    """``state`` if a ``device`` generator takes it (tried on a scratch generator), else
    ``ValueError``: a bad state never reaches the owner's generator."""
    if not isinstance(state, Tensor) or state.dtype != torch.uint8:
        found = state.dtype if isinstance(state, Tensor) else type(state).__name__
        raise ValueError(f"{owner} state_dict['generator'] must be a uint8 tensor from "
                         f"torch.Generator.get_state(), got {found}")
    try:  # torch's own checks
        torch.Generator(device).set_state(state)
    except (TypeError, RuntimeError) as error:
        raise ValueError(f"{owner} state_dict['generator'] is not the state of a {device} "
                         f"generator ({error}); pass the output of {owner}.state_dict()") from None
    return state

