"""Checkpoints of a whole balanced training run: every stateful object by name and the global
random states, saved atomically, loaded all or nothing (docs/loop.md, "Checkpoints").

Example:
    >>> import io
    >>> import torch
    >>> from gradbalance import AutoClip, load_checkpoint, save_checkpoint
    >>> from gradbalance.balancers import PCGrad
    >>> def build():
    ...     model = torch.nn.Linear(4, 2)
    ...     return model, torch.optim.SGD(model.parameters(), lr=0.1), PCGrad(), AutoClip()
    >>> model, opt, balancer, clipper = build()
    >>> f = io.BytesIO()  # or a path, "run.pt"
    >>> save_checkpoint(f, step=99, model=model, optimizer=opt, balancer=balancer,
    ...                 clipper=clipper)
    >>> # later, in a new process, after building fresh objects the same way:
    >>> model2, opt2, balancer2, clipper2 = build()
    >>> _ = f.seek(0)
    >>> meta = load_checkpoint(f, model=model2, optimizer=opt2, balancer=balancer2,
    ...                        clipper=clipper2)
    >>> meta["step"] + 1, torch.equal(model2.weight, model.weight)
    (100, True)
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import pickle
import re
import secrets
import stat
from collections import OrderedDict
from collections.abc import Mapping
from typing import IO, Any

import torch

from ._checks import check_bool, check_int
from ._rng_state import get_rng_state, set_rng_state

__all__ = [
    "CheckpointError", "CheckpointNotFoundError", "capture_state", "get_rng_state",
    "load_checkpoint", "restore_state", "save_checkpoint", "set_rng_state",
]

_FORMAT = 1

#: Leaf types ``torch.load(weights_only=True)`` reads back (exactly: not NumPy's float64).
_PLAIN_TYPES = frozenset({type(None), bool, int, float, complex, str, bytes, bytearray,
                          torch.dtype, torch.device, torch.Size, torch.layout, torch.Tensor,
                          torch.nn.Parameter})
_MAPPINGS = frozenset({dict, OrderedDict})
_SEQUENCES = frozenset({list, tuple, set})


class CheckpointError(ValueError):
    """A checkpoint that cannot be saved or loaded; the message names the file and why.

    Example:
        >>> import io
        >>> from gradbalance.checkpoint import CheckpointError, load_checkpoint
        >>> try:
        ...     load_checkpoint(io.BytesIO(b""))
        ... except CheckpointError as error:
        ...     print(error)
        checkpoint in BytesIO ends early: it is empty or cut short, not a whole checkpoint
    """


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No file at the path given to :func:`load_checkpoint` (also a ``FileNotFoundError``).

    Example:
        >>> import os, tempfile
        >>> from gradbalance.checkpoint import CheckpointNotFoundError, load_checkpoint
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     try:
        ...         load_checkpoint(os.path.join(folder, "missing.pt"))
        ...     except FileNotFoundError as error:
        ...         print(type(error).__name__)
        CheckpointNotFoundError
    """


def _state_of(name: str, obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return {"generator_state": obj.get_state()}
    if not callable(getattr(obj, "state_dict", None)):
        raise CheckpointError(
            f"{name} is a {type(obj).__name__} without state_dict(); pass objects with "
            f"state_dict()/load_state_dict() or a torch.Generator"
        )
    return obj.state_dict()


def _load_into(name: str, obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Generator):
        obj.set_state(state["generator_state"])
        return
    obj.load_state_dict(state)


def _disabled_scaler(obj: Any) -> bool:
    """Whether ``obj`` is a GradScaler that is disabled (its ``load_state_dict`` then
    returns without loading anything)."""
    enabled = getattr(obj, "is_enabled", None)
    return isinstance(obj, torch.amp.GradScaler) and callable(enabled) and not enabled()


def _check_target(name: str, obj: Any, state: Any, where: str) -> None:
    """Before anything loads: ``obj`` can take a state and a generator's entry is one."""
    if isinstance(obj, torch.Generator):
        if not isinstance(state, dict) or not isinstance(state.get("generator_state"),
                                                         torch.Tensor):
            raise CheckpointError(f"{where}: entry {name!r} is not a generator state")
    elif not callable(getattr(obj, "load_state_dict", None)):
        raise CheckpointError(f"{name} is a {type(obj).__name__} without load_state_dict()")
    elif _disabled_scaler(obj) and state:
        raise CheckpointError(
            f"{where}: entry {name!r} holds a GradScaler's state but the GradScaler given is "
            f"disabled (torch.amp.GradScaler() is CUDA's, disabled on a machine without CUDA) "
            f"and would drop it; build it as saved, e.g. torch.amp.GradScaler('cpu')")


def _round_trip_error(value: Any) -> str | None:
    """Why ``value`` does not survive ``torch.save`` + ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as error:
        return f"cannot be pickled ({_first_line(error)})"
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception:
        return "does not load back with torch.load(weights_only=True)"
    return None


def _fix_for(value: Any) -> str:
    module, kind = type(value).__module__, type(value).__name__
    if module.startswith("numpy") and kind == "ndarray":
        return "convert it with torch.from_numpy(value) or value.tolist()"
    if module.startswith("numpy") and callable(getattr(value, "item", None)):
        return "convert it with value.item() (or int(value), float(value))"
    return ("convert it to tensors and plain Python values (dict, list, tuple, str, int, "
            "float, bool, None), or allow its class with torch.serialization.add_safe_globals")


def _find_unloadable(value: Any, path: str, active: frozenset[int] = frozenset()
                     ) -> tuple[str, Any, str] | None:
    """The first value under ``value`` that a checkpoint cannot hold: (key path, value, why)."""
    kind = type(value)
    if kind in _PLAIN_TYPES:
        return None
    if id(value) in active:  # a container that holds itself: pickle keeps the cycle
        return None
    children: list[tuple[Any, str]] = []
    if kind in _MAPPINGS:
        for key, item in value.items():
            children += [(key, f"{path} (the key {key!r})"), (item, f"{path}[{key!r}]")]
    elif kind in _SEQUENCES:
        children = [(item, f"{path}[{i}]") for i, item in enumerate(value)]
    else:
        why = _round_trip_error(value)
        return None if why is None else (path, value, why)
    inner = active | {id(value)}
    for child, where in children:
        found = _find_unloadable(child, where, inner)
        if found:
            return found
    return None


def _check_loadable(value: Any, path: str) -> None:
    """Raise :class:`CheckpointError` for a value a checkpoint could not load back."""
    found = _find_unloadable(value, path)
    if found is not None:
        where, bad, why = found
        kind = type(bad).__qualname__
        if type(bad).__module__ != "builtins":
            kind = f"{type(bad).__module__}.{kind}"
        raise CheckpointError(
            f"save_checkpoint: {where} has type {kind}, which a checkpoint cannot hold: it "
            f"{why}; {_fix_for(bad)}. Nothing was written"
        )


def capture_state(*, rng: bool = True, **objects: Any) -> dict[str, Any]:
    """In-memory checkpoint: ``{"objects": {name: state}, "rng": ...}``, deep copies of the
    ``state_dict()`` of the objects not None.

    Example:
        >>> import torch
        >>> from gradbalance import capture_state
        >>> snapshot = capture_state(model=torch.nn.Linear(2, 1), scaler=None)
        >>> sorted(snapshot["objects"]["model"]), "rng" in snapshot
        (['bias', 'weight'], True)
    """
    check_bool("rng", rng)
    checkpoint = _capture(rng, objects)
    checkpoint["objects"] = copy.deepcopy(checkpoint["objects"])
    return checkpoint


def _capture(rng: bool, objects: dict[str, Any]) -> dict[str, Any]:
    """:func:`capture_state` without the copy (the states share the objects' tensors)."""
    states = {name: _state_of(name, obj) for name, obj in objects.items() if obj is not None}
    out: dict[str, Any] = {"format": _FORMAT, "objects": states}
    if rng:
        out["rng"] = get_rng_state()
    return out


def restore_state(checkpoint: dict[str, Any], *, strict: bool = True, **objects: Any) -> None:
    """Load :func:`capture_state` output into ``objects`` (matched by name; with ``strict``, the
    same names) and the RNGs, all or nothing (:class:`CheckpointError`).

    Example:
        >>> import torch
        >>> from gradbalance import capture_state, restore_state
        >>> trained, fresh = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        >>> restore_state(capture_state(model=trained), model=fresh)
        >>> torch.equal(fresh.weight, trained.weight)
        True
    """
    check_bool("strict", strict)
    _restore(checkpoint, "checkpoint", strict, objects, snapshot=True)


def _saved_objects(checkpoint: Any, where: str) -> dict[str, Any]:
    """The ``"objects"`` of a checkpoint this version reads."""
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("objects"), dict):
        held = (f"a dict with keys {sorted(checkpoint, key=str)[:10]}"
                if isinstance(checkpoint, dict) else f"a {type(checkpoint).__name__}")
        raise CheckpointError(
            f"{where} is not a gradbalance checkpoint: it holds {held}, not the dict of "
            f"save_checkpoint()/capture_state() (with 'format' and 'objects')"
        )
    version = checkpoint.get("format", _FORMAT)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= _FORMAT:
        raise CheckpointError(
            f"{where} has format {version!r}, which this gradbalance does not read (it reads "
            f"format {_FORMAT}); load it with the gradbalance version that wrote it, or newer"
        )
    objects: dict[str, Any] = checkpoint["objects"]
    return objects


def _restore(checkpoint: Any, where: str, strict: bool, objects: dict[str, Any],
             snapshot: bool = False) -> None:
    """Load ``checkpoint`` into ``objects``; ``snapshot``: an in-memory checkpoint the caller
    keeps (:func:`capture_state`'s), which each object loads a copy of: an optimizer keeps the
    tensors it is given, so training on would change the snapshot (a second restore of it
    loaded the later moments)."""
    saved = _saved_objects(checkpoint, where)
    given = {name: obj for name, obj in objects.items() if obj is not None}
    if strict:
        missing = sorted(set(given) - set(saved))
        unused = sorted(set(saved) - set(given))
        if missing or unused:
            raise CheckpointError(
                f"{where}: objects {sorted(saved)} do not match the objects given "
                f"{sorted(given)} (missing from the checkpoint: {missing}; saved but not "
                f"given: {unused}); pass the same names as when saving, or strict=False"
            )
    pairs = [(name, obj, _copy_state(saved[name], None) if snapshot and not isinstance(
        obj, torch.nn.Module) else saved[name]) for name, obj in given.items() if name in saved]
    for name, obj, state in pairs:
        _check_target(name, obj, state, where)
    _load_all(pairs, checkpoint.get("rng"), where)


def _copy_state(value: Any, device: str | None) -> Any:
    """A deep copy of a state (tensors detached, moved to ``device`` when given)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(device or value.device, copy=True)
    if type(value) in _MAPPINGS:
        out = copy.copy(value)  # keeps an OrderedDict's attributes (a module's _metadata)
        for key in out:
            out[key] = _copy_state(out[key], device)
        return out
    if type(value) in (list, tuple):
        return type(value)(_copy_state(item, device) for item in value)
    return copy.deepcopy(value)


def _snapshot(name: str, obj: Any) -> Any:
    """``obj``'s current state, to put back on failure (models and optimizers on CPU)."""
    large = isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))
    return _copy_state(_state_of(name, obj), "cpu" if large else None)


def _unchanged(name: str, obj: Any, snapshot: Any) -> bool:
    """Whether ``obj``'s state still equals ``snapshot`` (:func:`_snapshot`'s): a load that
    refused before changing anything needs no putting back."""
    try:
        return _same_state(_state_of(name, obj), snapshot)
    except Exception:
        return False


def _same_state(a: Any, b: Any) -> bool:
    """Equal states: the same structure, tensors of one dtype and shape with equal entries
    (NaN equal to NaN, compared on ``b``'s device), other values by ``==``."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _same_tensor(a, b)
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    try:
        return bool(a == b)
    except Exception:
        return False


def _same_tensor(a: Any, b: Any) -> bool:
    """Both tensors, of one dtype and shape, with equal entries (NaN equal to NaN)."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    moved = a.to(b.device)
    if moved.is_floating_point() or moved.is_complex():
        return bool(((moved == b) | (moved.isnan() & b.isnan())).all())
    return torch.equal(moved, b)


def _load_all(pairs: list[tuple[str, Any, Any]], rng: Any, where: str) -> None:
    """Load every object, then the RNGs; on any failure put back what was loaded."""
    done: list[tuple[str, Any, Any]] = []
    rng_before = None if rng is None else get_rng_state()
    current, target = "rng", "the global random generators"
    try:
        for name, obj, state in pairs:
            current, target = name, f"the {type(obj).__name__} given"
            done.append((name, obj, _snapshot(name, obj)))
            _load_into(name, obj, state)
        if rng is not None:
            current, target = "rng", "the global random generators"
            set_rng_state(rng)
    except Exception as error:
        failed = _roll_back(done, rng_before if current == "rng" else None)
        note = (f"; putting back {failed} failed as well: they are left part-loaded"
                if failed else "; nothing was changed")
        raise CheckpointError(
            f"{where}: entry {current!r} does not load into {target} "
            f"({type(error).__name__}: {error}){note}"
        ) from error


def _roll_back(done: list[tuple[str, Any, Any]], rng_before: Any) -> list[str]:
    """Put back the snapshots (latest first); the names whose snapshot did not load."""
    failed = []
    for name, obj, snapshot in reversed(done):
        try:
            _load_into(name, obj, snapshot)
        except Exception:  # one that refused to load at all (a buffer mid-step) is unchanged
            if not _unchanged(name, obj, snapshot):
                failed.append(name)
    if rng_before is not None:
        try:
            set_rng_state(rng_before)
        except Exception:
            failed.append("rng")
    return failed


def save_checkpoint(
    f: str | os.PathLike[str] | IO[bytes],
    *,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
    **objects: Any,
) -> None:
    """Save every named stateful object, the RNG states, ``step`` and ``extra`` to ``f`` (a path,
    atomically, or an open binary file); nothing is written for a value that would not load.

    Example:
        >>> import os, tempfile, torch
        >>> from gradbalance import save_checkpoint
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     save_checkpoint(os.path.join(folder, "run.pt"), model=torch.nn.Linear(2, 1))
        ...     print(os.listdir(folder))  # written atomically: no temporary file left
        ['run.pt']
    """
    _check_path_or_file(f)
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"Invalid extra: a {type(extra).__name__} (expected None or a dict of "
                         f"values to save with the checkpoint)")
    check_bool("rng", rng)
    extra = {} if extra is None else extra
    _check_loadable(extra, "extra")
    _check_loadable(step, "step")
    if step is not None:
        check_int("step", step, 0, ", the training step, or None")
    checkpoint = _capture(rng, objects)  # written at once: no copy needed
    for name, state in checkpoint["objects"].items():
        _check_loadable(state, f"{name}.state_dict()")
    checkpoint["step"] = step
    checkpoint["extra"] = extra
    if isinstance(f, (str, os.PathLike)):
        _write_atomic(os.fspath(f), checkpoint)
    else:
        _write_file(f, checkpoint)


def _write_file(f: IO[bytes], checkpoint: dict[str, Any]) -> None:
    """Serialise in memory, then one ``write`` into the caller's open file: a failure while
    serialising leaves it untouched, and a failed write (a full disk) raises
    :class:`CheckpointError` with the cause."""
    if getattr(f, "closed", False):
        raise ValueError("Invalid f: the file is closed; pass an open binary file or a path")
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    try:
        f.write(buffer.getbuffer())
    except (OSError, io.UnsupportedOperation) as error:
        raise CheckpointError(f"cannot save checkpoint into {f!r}: {error}; pass a file open "
                              f"for binary writing with room for "
                              f"{buffer.getbuffer().nbytes} bytes") from error


def _check_path_or_file(f: object) -> None:
    """A path or an open binary file (``TypeError`` naming ``f`` otherwise)."""
    if not (isinstance(f, (str, os.PathLike)) or callable(getattr(f, "write", None))
            or callable(getattr(f, "read", None))):
        raise TypeError(f"Invalid f: a {type(f).__name__} (expected a path or an open binary "
                        f"file, e.g. 'runs/last.pt')")


def _write_atomic(path: str, checkpoint: dict[str, Any]) -> None:
    """Write to a temporary file beside ``path``, sync it, rename it over ``path``."""
    target = os.path.realpath(path)  # a symbolic link keeps pointing at the new file
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise CheckpointError(f"cannot save checkpoint {path}: folder {folder} does not exist")
    if os.path.isdir(target):
        raise CheckpointError(f"cannot save checkpoint {path}: it is a directory")
    _check_writable(path, target)
    temp = os.path.join(folder, f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
    try:
        _write_synced(temp, checkpoint)
        with contextlib.suppress(FileNotFoundError):  # keep the replaced file's permissions
            os.chmod(temp, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _sync_folder(folder)


def _check_writable(path: str, target: str) -> None:
    """Raise ``PermissionError`` for an existing file this process may not write."""
    if not os.path.isfile(target):
        return
    try:
        os.close(os.open(target, os.O_WRONLY | getattr(os, "O_BINARY", 0)))
    except PermissionError as error:
        raise PermissionError(
            error.errno, f"cannot save checkpoint {path}: the file is write-protected "
            f"({stat.filemode(os.stat(target).st_mode)}); make it writable (chmod u+w) or save "
            f"to another path", path) from error


def _write_synced(temp: str, checkpoint: dict[str, Any]) -> None:
    """A new file (permissions from the umask), written, flushed and fsync'ed."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    with open(os.open(temp, flags, 0o666), "wb") as handle:
        torch.save(checkpoint, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _sync_folder(folder: str) -> None:
    """``fsync`` the folder, so the rename is on disk too (skipped where the OS refuses)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(
    f: str | os.PathLike[str] | IO[bytes],
    *,
    strict: bool = True,
    map_location: Any = None,
    **objects: Any,
) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` file into ``objects``; returns ``{"step", "extra"}``, or
    raises :class:`CheckpointError`, changing nothing.

    Example:
        >>> import os, tempfile, torch
        >>> from gradbalance import load_checkpoint, save_checkpoint
        >>> model, fresh = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     save_checkpoint(os.path.join(folder, "run.pt"), step=10, model=model)
        ...     meta = load_checkpoint(os.path.join(folder, "run.pt"), model=fresh)
        >>> meta, torch.equal(fresh.weight, model.weight)
        ({'step': 10, 'extra': {}}, True)
    """
    check_bool("strict", strict)
    _check_path_or_file(f)
    _check_map_location(map_location)
    where = _describe(f)
    checkpoint = _read(f, where, map_location)
    _restore(checkpoint, where, strict, objects)
    return {"step": checkpoint.get("step"), "extra": checkpoint.get("extra", {})}


def _describe(f: str | os.PathLike[str] | IO[bytes]) -> str:
    if isinstance(f, (str, os.PathLike)):
        return f"checkpoint {os.fspath(f)}"
    name = getattr(f, "name", None)
    return f"checkpoint {name}" if isinstance(name, str) else f"checkpoint in {type(f).__name__}"


def _check_map_location(value: Any) -> None:
    """A device name or ``torch.device`` must name a device (the mappings and callables
    ``torch.load`` takes are passed on as they are)."""
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            raise ValueError(f"Invalid map_location: {value!r} (expected a device such as "
                             f"'cpu' or 'cuda:0', a torch.device, a dict or a callable, as "
                             f"torch.load takes)") from None


def _read(f: str | os.PathLike[str] | IO[bytes], where: str, map_location: Any) -> Any:
    """``torch.load(weights_only=True)`` with one error type for every unreadable file."""
    if isinstance(f, (str, os.PathLike)):
        _check_file(os.fspath(f), where)
    try:
        return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        if "weights only load failed" in str(error).lower():
            raise CheckpointError(
                f"{where} holds values other than tensors and plain Python values "
                f"({_refused_global(error)}); save_checkpoint never writes those, so the file "
                f"comes from another program"
            ) from None
        raise CheckpointError(f"{where} is not a readable checkpoint: {_first_line(error)}"
                              ) from error
    except EOFError as error:
        raise CheckpointError(
            f"{where} ends early: it is empty or cut short, not a whole checkpoint"
        ) from error
    except Exception as error:
        raise CheckpointError(
            f"{where} is not a readable checkpoint (truncated, or not written by torch.save): "
            f"{_first_line(error)}"
        ) from error


def _check_file(path: str, where: str) -> None:
    if not os.path.exists(path):
        raise CheckpointNotFoundError(f"{where} does not exist")
    if os.path.isdir(path):
        raise CheckpointError(f"{where} is a directory; pass the file save_checkpoint wrote")
    if os.path.getsize(path) == 0:
        raise CheckpointError(f"{where} is empty (0 bytes), not a checkpoint")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    first = text[0].split(". ")[0] if text else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def _refused_global(error: BaseException) -> str:
    """The class the weights-only unpickler refused, from its message."""
    match = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
    return f"it refers to {match.group(1)}" if match else "an object torch.load refuses"
