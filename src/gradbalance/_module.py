"""The ``nn.Module`` base of balancers and loss weightings: state in buffers, atomic loads.

Tensor state is a registered buffer (persistent, so it is in ``state_dict`` and moves with
``.to()``); learnable weights the user's optimizer trains are ``nn.Parameter``; everything
else a resume needs (generator states, Python counters, an internal optimizer's state and
``"_type"``, the class that saved the state) is the module's *extra state*. A buffer that is
None until the first call (an EMA, a warm start: registered with ``optional=True``) is
absent from ``state_dict`` while None, and an absent key loads as None.

Loads are all or nothing: :meth:`StateModule.load_state_dict` checks the class, the keys, the
shapes and the extra state of the object and of its stateful submodules (CR-MOGM's inner
balancer) first and raises ``ValueError`` before anything changes. Loaded as part of a parent
module, the same checks run before the object's first tensor is copied; a refusal is then one
of ``load_state_dict``'s error messages and leaves the object (and its stateful submodules)
as they were. A dict in the flat format of 0.1 and 0.2 (``state_dict()`` before balancers
were modules, with ``"_type"`` at the top) is converted first (:meth:`_from_legacy`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _torch_module

from ._pickling import PicklableGenerators
from ._statedict import TYPE_KEY, check_keys, check_saved_type

_M = TypeVar("_M", bound="StateModule")

#: The key of a module's extra state in its ``state_dict`` (``torch.nn.Module``'s).
EXTRA_KEY = "_extra_state"


class StateModule(PicklableGenerators, nn.Module):
    """``nn.Module`` whose state loads all or nothing, tagged with the class that saved it.

    A subclass registers its tensor state with :meth:`register_state`, lists the keys of its
    extra state in ``_extra_keys`` and implements :meth:`_extra_state` /
    :meth:`_load_extra` (and :meth:`_check_state` for checks across entries). The old flat
    key of a buffer whose name changed goes in ``_legacy_keys``.
    """

    #: What the object is, in messages ("balancer", "weighting").
    _kind: ClassVar[str] = "object"
    #: The keys of the extra state besides ``"_type"``.
    _extra_keys: ClassVar[tuple[str, ...]] = ()
    #: Old flat ``state_dict`` key -> buffer or parameter name, where not ``_`` + the key.
    _legacy_keys: ClassVar[dict[str, str]] = {}

    _optional_state: dict[str, tuple[int, ...] | None]

    def __new__(cls: type[_M], *args: Any, **kwargs: Any) -> _M:
        # nn.Module's set-up happens here, so that a subclass whose __init__ never calls
        # super().__init__() (0.2 allowed it) still gets its dicts of buffers and submodules.
        obj = super().__new__(cls)
        nn.Module.__init__(obj)
        obj.__dict__["_optional_state"] = {}
        return obj

    def __init__(self) -> None:
        """Nothing left to set up (see :meth:`__new__`)."""

    # -- declaring state ----------------------------------------------------------------
    def register_state(self, name: str, value: Tensor | None, *, optional: bool = False,
                       shape: tuple[int, ...] | None = None) -> None:
        """Register a persistent buffer. ``optional``: may be None (absent from the state);
        ``shape``: the shape a loaded value must have (default: any, for an optional one;
        the current shape otherwise)."""
        self.register_buffer(name, value)
        if optional:
            self._optional_state[name] = shape

    def _extra_state(self) -> dict[str, Any]:
        """The non-tensor state (copies), without ``"_type"``."""
        return {}

    def _check_state(self, tensors: dict[str, Tensor | None], extra: dict[str, Any]) -> None:
        """Raise ``ValueError`` for a state this object cannot take (before any change)."""
        check_keys(type(self).__name__, extra, self._extra_keys, kind=self._kind)

    def _load_extra(self, extra: dict[str, Any]) -> None:
        """Restore :meth:`_extra_state` output, once checked; must not fail."""

    def _state_device(self) -> torch.device | None:
        """Where an optional buffer loads when it is None now (None: where it was saved)."""
        return None

    def __setattr__(self, name: str, value: Any) -> None:
        # Fast path for the per-step ``self._ema = ema``: a registered buffer replaced by a
        # plain tensor (or None) needs none of nn.Module.__setattr__'s checks (~5 µs a call).
        buffers = self.__dict__.get("_buffers")
        if (buffers is not None and name in buffers and (value is None or type(value) is Tensor)
                and not _torch_module._global_buffer_registration_hooks):
            buffers[name] = value
        else:
            super().__setattr__(name, value)

    # -- nn.Module hooks ----------------------------------------------------------------
    def get_extra_state(self) -> dict[str, Any]:
        """``"_type"`` (the class name) and the non-tensor state."""
        return {TYPE_KEY: type(self).__name__, **self._extra_state()}

    def set_extra_state(self, state: Any) -> None:
        """Restore :meth:`get_extra_state` output (checked first)."""
        own: dict[str, Any] = {name: value for name, value in self._slots().items()
                               if value is not None}
        own[EXTRA_KEY] = state
        _, extra = self._plan(own)
        self._load_extra(extra)

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        # Copies, not views: a saved state must not follow the object's later in-place steps.
        for name, value in self._slots().items():
            if value is not None:
                destination[prefix + name] = value if keep_vars else value.detach().clone()
        destination[prefix + EXTRA_KEY] = self.get_extra_state()

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Restore ``state_dict()`` output; works on a freshly built object.

        Raises ``ValueError``, changing nothing, for a state saved by another class, with
        unknown or missing keys, or with tensors of another shape. The flat states of 0.1
        and 0.2 load too.
        """
        if not isinstance(state_dict, Mapping):
            raise ValueError(
                f"{type(self).__name__}.load_state_dict expects the dict returned by "
                f"state_dict(), got a {type(state_dict).__name__}"
            )
        state = state_dict if EXTRA_KEY in state_dict else self._from_legacy(state_dict)
        for module, prefix in self._state_tree(""):
            module._plan(_own_entries(state, prefix, module))
        return super().load_state_dict(state, strict=strict, assign=assign)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              local_metadata: dict[str, Any], strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str],
                              error_msgs: list[str]) -> None:
        if self.__dict__.get("_loaded_by") is error_msgs:  # an enclosing StateModule did it
            del self.__dict__["_loaded_by"]
            return
        for hook in self._load_state_dict_pre_hooks.values():
            hook(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                 error_msgs)
        tree = list(self._state_tree(prefix))
        for module, _ in tree[1:]:
            module.__dict__["_loaded_by"] = error_msgs
        if not any(key.startswith(prefix) for key in state_dict):
            for module, p in tree:
                missing_keys.extend(p + name for name in [*module._slots(), EXTRA_KEY]
                                    if name not in module._optional_state)
            return
        try:
            plans = [(module, module._plan(_own_entries(state_dict, p, module)))
                     for module, p in tree]
        except ValueError as error:
            error_msgs.append(f"{prefix or type(self).__name__ + ': '}{error}")
            return
        for module, (tensors, extra) in plans:
            module._commit(tensors, extra)

    # -- loading ------------------------------------------------------------------------
    def _slots(self) -> dict[str, Tensor | None]:
        """Parameters and persistent buffers by name (None: an optional buffer not set)."""
        slots: dict[str, Tensor | None] = dict(self._parameters)
        slots.update({name: value for name, value in self._buffers.items()
                      if name not in self._non_persistent_buffers_set})
        return slots

    def _state_tree(self, prefix: str) -> Iterator[tuple[StateModule, str]]:
        """This object and its stateful submodules, with their key prefixes."""
        for name, module in self.named_modules():
            if isinstance(module, StateModule):
                yield module, prefix + name + "." if name else prefix

    def _plan(self, own: Mapping[str, Any]) -> tuple[dict[str, Tensor | None], dict[str, Any]]:
        """Check this object's entries (keys without prefix); the tensors and extra to load."""
        name = type(self).__name__
        extra = own.get(EXTRA_KEY)
        if not isinstance(extra, dict):
            raise ValueError(
                f"{name} state_dict has keys {sorted(own, key=str)} but no dict under "
                f"{EXTRA_KEY!r} (the class that saved it and the non-tensor state); pass "
                f"the dict returned by {name}.state_dict()"
            )
        check_saved_type(extra.get(TYPE_KEY, name), name, self._kind)
        slots = self._slots()
        check_keys(name, {key: v for key, v in own.items() if key != EXTRA_KEY}, slots,
                   kind=self._kind)
        tensors: dict[str, Tensor | None] = {}
        for key in slots:
            value = own.get(key)
            if value is None:
                if key not in self._optional_state:
                    raise ValueError(
                        f"{name} state_dict lacks {key!r} (has {sorted(own, key=str)}); was it "
                        f"saved from another {self._kind}?"
                    )
                tensors[key] = None
                continue
            if not isinstance(value, Tensor):
                raise ValueError(f"{name} state_dict[{key!r}] must be a tensor, got a "
                                 f"{type(value).__name__}")
            tensors[key] = value
        rest = {key: value for key, value in extra.items() if key != TYPE_KEY}
        self._check_state(tensors, rest)  # the class's own checks name the setting first
        for key, value in tensors.items():
            current = slots[key]
            shape = (self._optional_state[key] if key in self._optional_state
                     else None if current is None else tuple(current.shape))
            if value is not None and shape is not None and tuple(value.shape) != shape:
                raise ValueError(
                    f"{name} state_dict[{key!r}] has shape {tuple(value.shape)}, expected "
                    f"{shape}; load a state saved by a {name} built with the same settings "
                    f"(number of tasks)"
                )
        return tensors, rest

    def _commit(self, tensors: dict[str, Tensor | None], extra: dict[str, Any]) -> None:
        """Write a checked state. Parameters and tensors trained in place keep their identity
        (optimizers hold them); other buffers are replaced by copies."""
        home = self._state_device()
        with torch.no_grad():
            for key, value in tensors.items():
                current = self._parameters.get(key, self._buffers.get(key))
                if value is None:
                    self._buffers[key] = None
                elif current is not None and (key in self._parameters or current.requires_grad):
                    current.copy_(value)
                elif current is not None and key not in self._optional_state:
                    self._buffers[key] = value.detach().to(device=current.device,
                                                           dtype=current.dtype, copy=True)
                else:
                    where = current.device if current is not None else home or value.device
                    self._buffers[key] = value.detach().to(device=where, copy=True)
        self._load_extra(extra)

    def _from_legacy(self, flat: Mapping[str, Any]) -> dict[str, Any]:
        """A flat state of 0.1/0.2 (``"_type"`` and tensors at the top, stateful submodules
        under ``"<name>."``) in the module format."""
        state = dict(flat)
        extra: dict[str, Any] = {TYPE_KEY: state.pop(TYPE_KEY, type(self).__name__)}
        children = {name: module for name, module in self._modules.items()
                    if isinstance(module, StateModule)}
        nested: dict[str, dict[str, Any]] = {name: {} for name in children}
        slots = self._slots()
        out: dict[str, Any] = {}
        for key, value in state.items():
            head, _, rest = str(key).partition(".")
            if rest and head in children:
                nested[head][rest] = value
            elif (target := _legacy_target(self, key, slots)) is not None:
                if value is not None:
                    out[target] = value
            else:
                extra[key] = value
        for name, module in children.items():
            out.update({f"{name}.{key}": value
                        for key, value in module._from_legacy(nested[name]).items()})
        out[EXTRA_KEY] = extra
        return out


def _legacy_target(module: StateModule, key: Any, slots: Mapping[str, Any]) -> str | None:
    """The buffer or parameter an old flat key loads into, or None (extra state)."""
    if key in module._legacy_keys:
        return module._legacy_keys[key]
    if key in slots:
        return str(key)
    if not module._legacy_keys and f"_{key}" in slots:
        return f"_{key}"
    return None


def _own_entries(state: Mapping[str, Any], prefix: str, module: nn.Module) -> dict[str, Any]:
    """The entries of ``state`` under ``prefix`` that belong to ``module`` itself."""
    own = {}
    for key, value in state.items():
        if isinstance(key, str) and key.startswith(prefix):
            name = key[len(prefix):]
            if name.partition(".")[0] not in module._modules or "." not in name:
                own[name] = value
    return own
