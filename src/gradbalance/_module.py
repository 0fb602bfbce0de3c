"""The ``nn.Module`` base of balancers and loss weightings: declared state, atomic loads.

Every state tensor is declared once (:meth:`StateModule.register_state`), which generates
``reset()``, the load checks and the call's task check; everything else a resume needs is the
module's extra state, tagged with the class that saved it. A load is checked whole, submodules
included, before anything changes; loaded inside a parent module, a refusal is one of the
parent's ``load_state_dict`` error messages (docs/ARCHITECTURE.md, "Extension contract";
docs/loop.md, "Checkpoints").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ._pickling import PicklableGenerators
from ._state_spec import StateSpec
from ._statedict import TYPE_KEY, check_dict, check_keys, check_saved_type, tag_state

#: The key of a module's extra state in its ``state_dict`` (``torch.nn.Module``'s).
EXTRA_KEY = "_extra_state"

_UNDECLARED = StateSpec(None)


class StateModule(PicklableGenerators, nn.Module):
    """``nn.Module`` whose state is declared, loads all or nothing, and is tagged with the
    class that saved it; extra state: ``_extra_keys``, :meth:`_extra_state`, :meth:`_load_extra`
    (and :meth:`_check_state` for checks across entries)."""

    #: What the object is, in messages ("balancer", "weighting").
    _kind: ClassVar[str] = "object"
    #: The keys of the extra state besides ``"_type"``.
    _extra_keys: ClassVar[tuple[str, ...]] = ()
    #: Non-tensor state that :meth:`reset` rebuilds: (attribute, the method that makes its
    #: value as at construction) pairs (an own optimizer, a generator at its first state).
    _rebuilt: ClassVar[tuple[tuple[str, str], ...]] = ()
    #: The settings ``repr()`` shows, in order (empty: ``nn.Module``'s own repr).
    _repr_args: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        super().__init__()
        self._state_specs: dict[str, StateSpec] = {}

    # -- declaring state ----------------------------------------------------------------
    def register_state(self, name: str, default: Tensor | None, *, optional: bool = False,
                       shape: tuple[int, ...] | None = None, per_task: bool = False,
                       task_dim: int = 0, like_rows: bool = False,
                       persistent: bool = True, finite: bool = True,
                       pairwise: bool = False) -> None:
        """Declare a state tensor (a buffer; an ``nn.Parameter`` is registered as one).

        ``default``: its value now and after :meth:`reset` (None needs ``optional``); the
        other arguments are :class:`~gradbalance._state_spec.StateSpec`'s (``per_task``: one
        entry per task along ``task_dim``; ``pairwise``: one per task pair, the last two
        dimensions).
        """
        if default is None and not optional:
            raise ValueError(f"Invalid default for state {name!r}: None (expected a tensor, "
                             f"or optional=True for a state set by the first call)")
        if isinstance(default, nn.Parameter):
            self.register_parameter(name, default)
        else:
            self.register_buffer(name, default, persistent=persistent)
        dtype = default.dtype if default is not None else None if like_rows else torch.float64
        self._state_specs[name] = StateSpec(
            None if default is None else default.detach().clone(), optional, shape,
            -1 if pairwise else task_dim if per_task or like_rows else None, like_rows,
            persistent, finite, pairwise, dtype)

    @property
    def state_specs(self) -> Mapping[str, StateSpec]:
        """The declared state of this object (not of its submodules), by name."""
        return dict(self._state_specs)

    def task_state(self) -> dict[str, tuple[StateSpec, Tensor | None]]:
        """The per-task state of this object (not of its submodules): name -> (its
        declaration, its value now)."""
        return {name: (spec, self._parameters.get(name, self._buffers.get(name)))
                for name, spec in self._state_specs.items() if spec.task_dim is not None}

    def put_state(self, name: str, value: Tensor | None) -> None:
        """Replace the declared buffer ``name`` by ``value`` (not a parameter: an optimizer
        holds those)."""
        if name not in self._state_specs or name in self._parameters:
            raise KeyError(f"{type(self).__name__} has no declared state buffer {name!r}")
        self._buffers[name] = value

    def reset(self) -> None:
        """Forget all state (as freshly built): every declared state back to its default
        (tensors an optimizer steps in place are reset in place), the :attr:`_rebuilt`
        attributes rebuilt, stateful submodules too."""
        home = self._state_device()
        with torch.no_grad():
            for name, spec in self._state_specs.items():
                current = self._parameters.get(name, self._buffers.get(name))
                value = spec.initial(current, home)
                if value is not None and current is not None and _trained(self, name, current):
                    current.copy_(value)
                else:
                    self._buffers[name] = value
        for attr, make in self._rebuilt:
            setattr(self, attr, getattr(self, make)())
        for child in self.children():
            if isinstance(child, StateModule):
                child.reset()

    def check_tracked_tasks(self, k: int, rows: Tensor | None = None) -> None:
        """Raise ``ValueError`` (nothing changed) when the per-task state of this object or its
        stateful submodules tracks another K than ``k``, or another shape than ``rows``."""
        for name, spec in self._state_specs.items():
            if spec.task_dim is not None:
                value = self._buffers.get(name, self._parameters.get(name))
                error = spec.call_error(type(self).__name__, value, k, rows)
                if error is not None:
                    raise ValueError(error)
        for child in self._modules.values():
            if isinstance(child, StateModule):
                child.check_tracked_tasks(k, rows)

    def __repr__(self) -> str:
        if not self._repr_args:
            return super().__repr__()
        args = ", ".join(f"{name}={_shown(getattr(self, name))}" for name in self._repr_args)
        return f"{type(self).__name__}({args})"

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

    # -- nn.Module hooks ----------------------------------------------------------------
    def get_extra_state(self) -> dict[str, Any]:
        """``"_type"`` (the class name) and the non-tensor state."""
        return tag_state(self, self._extra_state())

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
        unknown or missing keys, or with tensors of another shape or K, or holding inf/NaN.
        """
        check_dict(type(self).__name__, state_dict)
        for module, prefix in self._state_tree(""):
            module._plan(_own_entries(state_dict, prefix, module))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

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
            missing_keys.extend(_required_keys(tree))
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

    def _spec(self, name: str) -> StateSpec:
        return self._state_specs.get(name, _UNDECLARED)

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
        check_saved_type(extra.get(TYPE_KEY), name, self._kind)
        slots = self._slots()
        check_keys(name, {key: v for key, v in own.items() if key != EXTRA_KEY}, slots,
                   kind=self._kind)
        tensors = {key: self._loaded_tensor(key, own) for key in slots}
        rest = {key: value for key, value in extra.items() if key != TYPE_KEY}
        self._check_state(tensors, rest)  # the class's own checks name the setting first
        k, rows = self._tracked_shapes(tensors)
        for key, value in tensors.items():
            error = None if value is None else self._spec(key).load_error(
                name, key, value, slots[key], k, rows)
            if error is not None:
                raise ValueError(error)
        return tensors, rest

    def _tracked_shapes(self, loaded: Mapping[str, Tensor | None]
                        ) -> tuple[int | None, tuple[int, ...] | None]:
        """The K a load must keep (the ``num_tasks`` setting, else the current state's, else
        the first loaded entry's) and the ``[K, P]`` shape of the first loaded state like the
        rows (the loaded entries must agree on P)."""
        current = {**self._buffers, **self._parameters}
        k: int | None = self.__dict__.get("num_tasks")
        for values in (current, loaded):
            for key, value in values.items():
                k = self._spec(key).tasks_in(value) if k is None else k
        rows = next((tuple(value.shape) for key, value in loaded.items()
                     if value is not None and self._spec(key).like_rows), None)
        return k, rows

    def _loaded_tensor(self, key: str, own: Mapping[str, Any]) -> Tensor | None:
        """``own[key]``, checked to be a tensor (or absent, for an optional state)."""
        value = own.get(key)
        name = type(self).__name__
        if value is None and not self._spec(key).optional:
            raise ValueError(f"{name} state_dict lacks {key!r} (has {sorted(own, key=str)}); "
                             f"was it saved from another {self._kind}?")
        if value is not None and not isinstance(value, Tensor):
            raise ValueError(f"{name} state_dict[{key!r}] must be a tensor, got a "
                             f"{type(value).__name__}")
        return value

    def _commit(self, tensors: dict[str, Tensor | None], extra: dict[str, Any]) -> None:
        """Write a checked state. Parameters and tensors trained in place keep their identity
        (optimizers hold them); other buffers are replaced by copies."""
        home = self._state_device()
        with torch.no_grad():
            for key, value in tensors.items():
                current = self._parameters.get(key, self._buffers.get(key))
                if value is None:
                    self._buffers[key] = None
                elif current is not None and _trained(self, key, current):
                    current.copy_(value)
                elif current is not None and not self._spec(key).optional:
                    self._buffers[key] = value.detach().to(device=current.device,
                                                           dtype=current.dtype, copy=True)
                else:
                    where = current.device if current is not None else home or value.device
                    self._buffers[key] = value.detach().to(device=where,
                                                           dtype=self._spec(key).dtype, copy=True)
        self._load_extra(extra)


def _shown(value: Any) -> str:
    """A setting as ``repr()`` shows it (a tensor as its list of values)."""
    return repr(value.tolist() if isinstance(value, Tensor) else value)


def _trained(module: nn.Module, name: str, current: Tensor) -> bool:
    """Whether an optimizer steps this tensor in place (a parameter, or a trained buffer)."""
    return name in module._parameters or current.requires_grad


def _required_keys(tree: list[tuple[StateModule, str]]) -> list[str]:
    """The keys a load of ``tree`` needs (every slot but the optional ones, the extra state)."""
    return [prefix + name for module, prefix in tree
            for name in [*module._slots(), EXTRA_KEY] if not module._spec(name).optional]


def _own_entries(state: Mapping[str, Any], prefix: str, module: nn.Module) -> dict[str, Any]:
    """The entries of ``state`` under ``prefix`` that belong to ``module`` itself."""
    own = {}
    for key, value in state.items():
        if isinstance(key, str) and key.startswith(prefix):
            name = key[len(prefix):]
            if name.partition(".")[0] not in module._modules or "." not in name:
                own[name] = value
    return own
