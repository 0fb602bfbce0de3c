"""Checkpoints of a whole balanced training run: resume bit-identically.

Everything stateful is saved by name: the model, the optimizer, the ``GradScaler``, the
balancer, a loss weighting, clippers (:class:`~gradbalance.AutoClip`), loggers
(:class:`~gradbalance.RunningStats`), any ``torch.Generator``, and the global random states
(torch CPU and CUDA, Python's ``random``, NumPy's legacy global generator when NumPy is
installed). A run saved after N steps and loaded into freshly built objects continues exactly
as the uninterrupted run would have.

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

Files are read with ``torch.load(weights_only=True)``: they hold tensors and plain Python
values only.
"""

from __future__ import annotations

import os
import random
from typing import IO, Any

import torch

__all__ = [
    "capture_state",
    "get_rng_state",
    "load_checkpoint",
    "restore_state",
    "save_checkpoint",
    "set_rng_state",
]

_FORMAT = 1


def get_rng_state() -> dict[str, Any]:
    """The global random states: torch CPU, every CUDA device (if initialised), Python, NumPy."""
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": _to_plain(random.getstate()),
    }
    if (torch.cuda.is_available()
            and torch.cuda.is_initialized()):  # type: ignore[no-untyped-call]  # untyped in torch
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        return state
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple)  # the global RandomState is an MT19937: a 5-tuple
    kind, keys, pos, has_gauss, cached = legacy
    state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(keys.astype("int64")),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`get_rng_state` output."""
    if "torch" not in state or "python" not in state:
        raise ValueError(
            f"rng state has keys {sorted(state)}; pass the output of get_rng_state()"
        )
    torch.set_rng_state(state["torch"])
    random.setstate(_from_plain(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError as error:  # pragma: no cover - numpy is optional
            raise ImportError(
                "the checkpoint holds NumPy's random state but NumPy is not installed: "
                "pip install numpy"
            ) from error
        n = state["numpy"]
        np.random.set_state((n["kind"], n["keys"].numpy().astype("uint32"), n["pos"],
                             n["has_gauss"], n["cached"]))


def _to_plain(value: Any) -> Any:
    """Python's random state as nested lists (tuples do not survive every serialiser)."""
    if isinstance(value, tuple):
        return [_to_plain(v) for v in value]
    return value


def _from_plain(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_from_plain(v) for v in value)
    return value


def _state_of(name: str, obj: Any) -> Any:
    if isinstance(obj, torch.Generator):
        return {"generator_state": obj.get_state()}
    if not callable(getattr(obj, "state_dict", None)):
        raise ValueError(
            f"{name} is a {type(obj).__name__} without state_dict(); pass objects with "
            f"state_dict()/load_state_dict() or a torch.Generator"
        )
    return obj.state_dict()


def _load_into(name: str, obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Generator):
        if not isinstance(state, dict) or "generator_state" not in state:
            raise ValueError(f"checkpoint entry {name!r} is not a generator state")
        obj.set_state(state["generator_state"])
        return
    if not callable(getattr(obj, "load_state_dict", None)):
        raise ValueError(f"{name} is a {type(obj).__name__} without load_state_dict()")
    obj.load_state_dict(state)


def capture_state(*, rng: bool = True, **objects: Any) -> dict[str, Any]:
    """In-memory checkpoint: ``{"objects": {name: state}, "rng": ...}``. None objects skipped."""
    states = {name: _state_of(name, obj) for name, obj in objects.items() if obj is not None}
    out: dict[str, Any] = {"format": _FORMAT, "objects": states}
    if rng:
        out["rng"] = get_rng_state()
    return out


def restore_state(checkpoint: dict[str, Any], *, strict: bool = True, **objects: Any) -> None:
    """Load :func:`capture_state` output into ``objects`` (matched by name) and the RNGs.

    With ``strict``, every object passed must be in the checkpoint and every saved object
    must be passed, so nothing is silently left in its fresh state.
    """
    if not isinstance(checkpoint, dict) or "objects" not in checkpoint:
        raise ValueError("checkpoint lacks 'objects'; pass the output of capture_state()")
    saved = checkpoint["objects"]
    given = {name: obj for name, obj in objects.items() if obj is not None}
    if strict:
        missing = sorted(set(given) - set(saved))
        unused = sorted(set(saved) - set(given))
        if missing or unused:
            raise ValueError(
                f"checkpoint objects {sorted(saved)} do not match the objects given "
                f"{sorted(given)} (missing from the checkpoint: {missing}; saved but not "
                f"given: {unused}); pass the same names as when saving, or strict=False"
            )
    for name, obj in given.items():
        if name in saved:
            _load_into(name, obj, saved[name])
    if "rng" in checkpoint:
        set_rng_state(checkpoint["rng"])


def save_checkpoint(
    f: str | os.PathLike[str] | IO[bytes],
    *,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    rng: bool = True,
    **objects: Any,
) -> None:
    """Save every named stateful object, the RNG states, ``step`` and ``extra`` to ``f``."""
    checkpoint = capture_state(rng=rng, **objects)
    checkpoint["step"] = step
    checkpoint["extra"] = {} if extra is None else extra
    torch.save(checkpoint, f)


def load_checkpoint(
    f: str | os.PathLike[str] | IO[bytes],
    *,
    strict: bool = True,
    map_location: Any = None,
    **objects: Any,
) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` file into ``objects``; returns ``{"step", "extra"}``."""
    checkpoint = torch.load(f, map_location=map_location, weights_only=True)
    restore_state(checkpoint, strict=strict, **objects)
    return {"step": checkpoint.get("step"), "extra": checkpoint.get("extra", {})}
