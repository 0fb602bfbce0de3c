"""Loss weightings whose weights their own optimizer steps (GradNorm, FAMO).

Such a weighting keeps its trained tensor as a buffer with ``requires_grad`` (named in
``_self_trained``), so an optimizer built from ``model.parameters()`` never steps it a second
time, and saves its optimizer's state as extra state. A state is checked against a scratch
optimizer first (:func:`~gradbalance.weighting._base.check_optimizer_state`), so a load that
would fail changes nothing; ``.to()`` rebuilds the optimizer on the moved tensor with its
state (:meth:`LossWeighting._apply`).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar

import torch
from torch import Tensor

from ._base import LossWeighting, check_optimizer_state


class OwnOptimizerWeighting(LossWeighting):
    """A :class:`LossWeighting` with one self-trained buffer and its own ``optimizer``.

    A subclass names the buffer in ``_self_trained`` (one entry) and implements
    :meth:`_make_optimizer`.
    """

    _extra_keys: ClassVar[tuple[str, ...]] = ("num_tasks", "optimizer")
    optimizer: torch.optim.Optimizer

    def _make_optimizer(self, trained: Tensor | None = None) -> torch.optim.Optimizer:
        """An optimizer over ``trained`` (default: the self-trained buffer)."""
        raise NotImplementedError

    def _trained(self) -> Tensor:
        tensor = self._buffers[self._self_trained[0]]
        assert tensor is not None
        return tensor

    def _extra_state(self) -> dict[str, Any]:
        return {**super()._extra_state(),
                "optimizer": copy.deepcopy(self.optimizer.state_dict())}

    def _check_state(self, tensors: dict[str, Tensor | None], extra: dict[str, Any]) -> None:
        super()._check_state(tensors, extra)
        check_optimizer_state(self._make_optimizer, self._trained(), extra.get("optimizer"),
                              type(self).__name__)

    def _load_extra(self, extra: dict[str, Any]) -> None:
        super()._load_extra(extra)
        self.optimizer.load_state_dict(copy.deepcopy(extra["optimizer"]))

    def _own_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    def _rebuild_optimizer(self, state: dict[str, Any]) -> None:
        self.optimizer = self._make_optimizer()
        self.optimizer.load_state_dict(state)
