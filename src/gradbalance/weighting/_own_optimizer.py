"""Loss weightings whose weights their own optimizer steps (GradNorm, FAMO): a per-task
buffer with ``requires_grad`` (so the user's optimizer never steps it) and the optimizer's
state as extra state, checked on a scratch optimizer before a load (docs/weighting.md)."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._caller import user_stacklevel
from ._base import LossWeighting

OptimizerFactory = Callable[[list[Tensor]], torch.optim.Optimizer]


def check_optimizer_state(make: Callable[[Tensor], torch.optim.Optimizer], param: Tensor,
                          state: Any, owner: str) -> None:
    """Raise ``ValueError`` unless ``state`` loads into an optimizer like ``owner``'s own.

    Loaded into a scratch optimizer built on a copy of ``param``: nothing of ``owner`` moves.
    Its moments must have ``param``'s shape (one entry per task) and be finite.
    """
    if not isinstance(state, dict):
        raise ValueError(f"state_dict lacks 'optimizer' (the state of {owner}'s own "
                         f"optimizer); was it saved from another {owner}?")
    scratch = make(param.detach().clone().requires_grad_(True))
    try:
        scratch.load_state_dict(copy.deepcopy(state))
    except (ValueError, KeyError, TypeError, RuntimeError, AttributeError) as error:
        raise ValueError(f"state_dict['optimizer'] does not load into {owner}'s optimizer "
                         f"({error}); was it saved with another optimizer?") from error
    expected = _stepped_state(make, param)
    for entries in scratch.state.values():
        if set(entries) != set(expected):
            raise ValueError(f"state_dict['optimizer'] holds a parameter state with keys "
                             f"{sorted(entries)} but {owner}'s optimizer keeps {sorted(expected)} "
                             f"after a step; pass the output of {owner}.state_dict()")
        for key, value in entries.items():
            _check_kind(owner, key, value, expected[key])
            _check_moment(owner, key, value, param)


def _stepped_state(make: Callable[[Tensor], torch.optim.Optimizer],
                   param: Tensor) -> dict[str, Any]:
    """A parameter's state in an optimizer like ``make``'s after one step (on a scratch copy
    of ``param``, a zero gradient), by key."""
    copy_ = param.detach().clone().requires_grad_(True)
    scratch = make(copy_)
    copy_.grad = torch.zeros_like(copy_)
    scratch.step()
    return {str(key): value for entries in scratch.state.values()
            for key, value in entries.items()}


def _check_kind(owner: str, key: str, value: Any, reference: Any) -> None:
    """Raise ``ValueError`` where the optimizer keeps a tensor of one entry per task
    (``reference``: its own after a step) and the state holds anything else (a list from a
    state that went through JSON: the next step raised half-way, its count moved)."""
    if isinstance(reference, Tensor) and reference.dim() > 0 and not isinstance(value, Tensor):
        raise ValueError(f"state_dict['optimizer'] holds {key!r} as a {type(value).__name__} "
                         f"(expected a tensor of shape {tuple(reference.shape)}, one entry per "
                         f"task); pass the output of {owner}.state_dict(), saved with "
                         f"torch.save or save_checkpoint")


def _real_and_signed(key: str, value: Tensor) -> bool:
    """Real numbers, not flags; a step count (one number) and second moments (``*_sq``)
    ``>= 0``."""
    if value.dtype == torch.bool or value.is_complex():
        return False
    signed = value.dim() == 0 or key.endswith("_sq")
    return not (signed and bool((value < 0).any()))


def _check_moment(owner: str, key: str, value: Any, param: Tensor) -> None:
    """Raise ``ValueError`` for an optimizer state entry of another shape than ``param``'s
    (another number of tasks) or holding inf/NaN."""
    if not isinstance(value, Tensor):
        if isinstance(value, bool) or (isinstance(value, (int, float)) and not value >= 0):
            raise ValueError(f"state_dict['optimizer'] holds {key!r} = {value!r} (expected a "
                             f"number >= 0); pass the output of {owner}.state_dict()")
        return
    if not _real_and_signed(key, value):
        raise ValueError(f"state_dict['optimizer'] holds {key!r} of dtype {value.dtype} with "
                         f"values down to {float(value.real.min())} (expected real numbers, a "
                         f"step count and second moments >= 0); pass the output of "
                         f"{owner}.state_dict()")
    if value.dim() > 0 and value.shape != param.shape:
        raise ValueError(f"state_dict['optimizer'] holds {key!r} of shape {tuple(value.shape)} "
                         f"but {owner} trains {tuple(param.shape)} (one entry per task); load "
                         f"a state saved with the same number of tasks")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise ValueError(f"state_dict['optimizer'][{key!r}] holds inf/NaN; the state was saved "
                         f"after a failed step or damaged: load an earlier checkpoint, or call "
                         f"reset() instead")


class OwnOptimizerWeighting(LossWeighting):
    """A :class:`LossWeighting` with one self-trained buffer and its own ``optimizer``.

    A subclass declares the buffer with :meth:`_register_trained` and implements
    :meth:`_default_optimizer`.
    """

    _extra_keys: ClassVar[tuple[str, ...]] = ("num_tasks", "optimizer")
    _rebuilt = (("optimizer", "_make_optimizer"),)
    #: ``(attribute, param-group key)``: the constructor's arguments the default optimizer
    #: takes (FAMO's ``lr``, ``gamma`` as ``weight_decay``), which a load sets from the
    #: saved group (:meth:`_follow_loaded_group`).
    _group_attributes: ClassVar[tuple[tuple[str, str], ...]] = ()
    optimizer: torch.optim.Optimizer

    def _register_trained(self, name: str, initial: Tensor,
                          factory: OptimizerFactory | None) -> None:
        """Declare the per-task buffer ``name`` stepped by the own optimizer (``factory``,
        else :meth:`_default_optimizer`) and build that optimizer."""
        self._trained_name = name
        self._factory = factory
        self.register_state(name, initial.requires_grad_(True), per_task=True)
        self.optimizer = self._make_optimizer()

    def _default_optimizer(self, params: list[Tensor]) -> torch.optim.Optimizer:
        """The optimizer used when no factory is given."""
        raise NotImplementedError

    def _make_optimizer(self, trained: Tensor | None = None) -> torch.optim.Optimizer:
        """An optimizer over ``trained`` (default: the self-trained buffer)."""
        params = [self._trained() if trained is None else trained]
        return self._default_optimizer(params) if self._factory is None else \
            self._factory(params)

    def _trained(self) -> Tensor:
        tensor = self._buffers[self._trained_name]
        assert tensor is not None
        return tensor

    def _extra_state(self) -> dict[str, Any]:
        return {**super()._extra_state(),
                "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def _check_state(self, tensors: dict[str, Tensor | None], extra: dict[str, Any]) -> None:
        super()._check_state(tensors, extra)
        check_optimizer_state(self._make_optimizer, self._trained(), extra.get("optimizer"),
                              type(self).__name__)
        self._warn_group_changes(extra["optimizer"]["param_groups"][0])

    def _load_extra(self, extra: dict[str, Any]) -> None:
        super()._load_extra(extra)
        self.optimizer.load_state_dict(copy.deepcopy(extra["optimizer"]))
        self._follow_loaded_group()

    def _changed_attributes(self, group: dict[str, Any]) -> list[tuple[str, Any]]:
        """``(attribute, value)`` of the default optimizer's saved ``group`` that differ
        from the attributes (none with a user's optimizer factory)."""
        if self._factory is not None:
            return []
        return [(attr, group[key]) for attr, key in self._group_attributes
                if getattr(self, attr) != group[key]]

    def _warn_group_changes(self, group: dict[str, Any]) -> None:
        """Before a load moves anything: a warning naming each hyperparameter the saved
        group replaces (an error filter raises here, with nothing loaded)."""
        changed = [f"{attr}={getattr(self, attr)!r} -> {value!r}"
                   for attr, value in self._changed_attributes(group)]
        if changed:
            warnings.warn(f"{type(self).__name__}.load_state_dict: the saved optimizer's "
                          f"hyperparameters replace the constructor's ({', '.join(changed)}), "
                          f"as torch.optim restores them; to step with others, set "
                          f"{type(self).__name__}.optimizer.param_groups[0] after loading",
                          stacklevel=user_stacklevel())

    def _follow_loaded_group(self) -> None:
        """The default optimizer steps with the saved hyperparameters (PyTorch's
        ``Optimizer.load_state_dict`` restores its param groups, so a resumed run is the
        saved one's): the attributes they came from follow them, so the repr and a later
        :meth:`reset` agree with the steps (:meth:`_warn_group_changes` said so)."""
        for attr, value in self._changed_attributes(self.optimizer.param_groups[0]):
            setattr(self, attr, value)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> Any:
        """``.to()``, ``.double()``...: the trained buffer stays a leaf and the optimizer
        follows it with its state."""
        before, saved = self._trained(), self.optimizer.state_dict()
        out = super()._apply(fn, recurse)
        if self._trained() is not before:
            self._buffers[self._trained_name] = self._trained().detach().requires_grad_(True)
            self.optimizer = self._make_optimizer()
            self.optimizer.load_state_dict(saved)
        return out
