"""The global random states a checkpoint saves: torch's CPU and CUDA generators, Python's and
NumPy's (docs/checkpoints.md). Restoring checks every entry before it sets any, so a
malformed state raises a ``ValueError`` naming the entry and leaves every generator as it
was."""

from __future__ import annotations

import random
from typing import Any

import torch

from ._statedict import as_lists, as_tuples

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """The global random states: torch CPU, every CUDA device (if initialised), Python, NumPy.

    Example:
        >>> from gradbalance.checkpoint import get_rng_state
        >>> state = get_rng_state()
        >>> state["torch"].dtype, "python" in state  # torch's CPU generator, Python's random
        (torch.uint8, True)
    """
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": as_lists(random.getstate()),
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
    """Restore :func:`get_rng_state` output; a malformed entry raises ``ValueError`` (naming
    it) before any generator moves.

    Example:
        >>> import torch
        >>> from gradbalance.checkpoint import get_rng_state, set_rng_state
        >>> state = get_rng_state()
        >>> first = torch.rand(3)
        >>> set_rng_state(state)
        >>> torch.equal(torch.rand(3), first)  # the same draws again
        True
    """
    if not isinstance(state, dict) or "torch" not in state or "python" not in state:
        found = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"rng state has keys {found}; pass the output of get_rng_state()")
    cpu = _torch_state(state["torch"])
    python = _python_state(state["python"])
    cuda = _cuda_states(state["cuda"]) if "cuda" in state else None
    numpy = _numpy_state(state["numpy"]) if "numpy" in state else None
    torch.set_rng_state(cpu)
    random.setstate(python)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    if numpy is not None:
        import numpy as np

        np.random.set_state(numpy)


def _bad(entry: str, value: Any, expected: str) -> ValueError:
    shown = (f"a tensor of shape {tuple(value.shape)}, dtype {value.dtype}"
             if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
    return ValueError(f"rng state entry {entry!r} is {shown} (expected {expected}); pass the "
                      f"output of get_rng_state()")


def _torch_state(value: Any) -> torch.Tensor:
    """torch's CPU generator state: a ``uint8`` vector of the current state's length."""
    size = torch.get_rng_state().numel()
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.uint8
            and value.dim() == 1 and value.numel() == size):
        raise _bad("torch", value, f"a uint8 tensor of {size} bytes")
    return value


def _python_state(value: Any) -> Any:
    """Python's ``random`` state, checked on a generator of its own."""
    state = as_tuples(value)
    try:
        random.Random().setstate(state)
    except (TypeError, ValueError, OverflowError):
        raise _bad("python", value, "random.getstate()'s (version, 625 ints, gauss)") from None
    return state


def _cuda_states(value: Any) -> list[torch.Tensor]:
    """One ``uint8`` state per CUDA device."""
    if not (isinstance(value, (list, tuple))
            and all(isinstance(v, torch.Tensor) and v.dtype == torch.uint8 for v in value)):
        raise _bad("cuda", value, "a list of uint8 tensors, one per CUDA device")
    if torch.cuda.is_available() and len(value) != torch.cuda.device_count():
        raise ValueError(f"rng state entry 'cuda' holds {len(value)} device states but this "
                         f"process sees {torch.cuda.device_count()} CUDA devices; restore it "
                         f"where the checkpoint was saved, or drop the entry")
    return list(value)


_NUMPY_KEYS = ("kind", "keys", "pos", "has_gauss", "cached")


def _numpy_state(value: Any) -> tuple[Any, ...]:
    """NumPy's legacy global state, checked on a ``RandomState`` of its own."""
    try:
        import numpy as np
    except ImportError as error:  # pragma: no cover - numpy is optional
        raise ImportError("the checkpoint holds NumPy's random state but NumPy is not "
                          "installed: pip install numpy") from error
    expected = f"a dict with {list(_NUMPY_KEYS)}, as get_rng_state() makes it"
    if not (isinstance(value, dict) and set(_NUMPY_KEYS) <= set(value)
            and isinstance(value["keys"], torch.Tensor)):
        raise _bad("numpy", value, expected)
    legacy = (value["kind"], value["keys"].numpy().astype("uint32"), value["pos"],
              value["has_gauss"], value["cached"])
    try:
        np.random.RandomState().set_state(legacy)
    except (TypeError, ValueError, KeyError):
        raise _bad("numpy", value, expected) from None
    return legacy
