"""Uncertainty Weighting: learned homoscedastic task uncertainty (Kendall et al., 2018)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ._base import LossWeighting

__all__ = ["UncertaintyWeighting"]

_FORMS = {"regression": 0.5, "classification": 1.0}


class UncertaintyWeighting(LossWeighting):
    """Weigh each task by a learned noise level ``σₖ``, with ``sₖ = log σₖ²`` learnable.

    Weighted loss per task (``cₖ = 1/2`` for ``"regression"``, ``1`` for
    ``"classification"``)::

        cₖ·e^{−sₖ}·Lₖ + sₖ/2   (= Lₖ/(2σₖ²) + log σₖ, or Lₖ/σₖ² + log σₖ)

    so at ``σ = 1`` the weights are 0.5 and 1. The ``sₖ`` (``log_vars``, an ``nn.Parameter``)
    are trained by *your* optimizer (docs/weighting.md).

    Args:
        task_types: ``"regression"``, ``"classification"`` or one of them per task.
        init_log_var: initial ``sₖ`` (0: ``σ = 1``).
        dtype: dtype of ``s`` (float32 by default, like the model).

    Reference: Kendall, Gal & Cipolla, "Multi-Task Learning Using Uncertainty to Weigh Losses
    for Scene Geometry and Semantics", CVPR 2018.

    Example:
        >>> import torch
        >>> from gradbalance.weighting import UncertaintyWeighting
        >>> weighting = UncertaintyWeighting(2)  # log σ² = 0: L / (2σ²) + log σ = L / 2
        >>> weighting(torch.tensor([1.0, 2.0])).tolist()
        [0.5, 1.0]
    """

    log_vars: nn.Parameter

    name = "uncertainty"
    learnable = True
    _factor: Tensor

    def __init__(self, num_tasks: int, *, task_types: str | Sequence[str] = "regression",
                 init_log_var: float = 0.0, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_tasks, device=device)
        types = [task_types] * num_tasks if isinstance(task_types, str) else list(task_types)
        if len(types) != num_tasks or any(t not in _FORMS for t in types):
            raise ValueError(
                f"Invalid task_types: {task_types!r} (expected 'regression', 'classification' "
                f"or a list of {num_tasks} of them)"
            )
        if not isinstance(init_log_var, (int, float)) or not torch.isfinite(
                torch.tensor(float(init_log_var))):
            raise ValueError(f"Invalid init_log_var: {init_log_var!r} (expected a finite number)")
        self.task_types = types
        self.init_log_var = float(init_log_var)
        self.register_buffer("_factor", torch.tensor([_FORMS[t] for t in types], dtype=dtype,
                                                     device=self.device), persistent=False)
        self.register_state("log_vars", nn.Parameter(
            torch.full((num_tasks,), self.init_log_var, dtype=dtype, device=self.device)),
            per_task=True)

    def _weighted(self, losses: Tensor) -> Tensor:
        s = self.log_vars.to(dtype=losses.dtype, device=losses.device)
        c = self._factor.to(dtype=losses.dtype, device=losses.device)
        return c * torch.exp(-s) * losses + 0.5 * s

    @property
    def weights(self) -> Tensor:
        """``cₖ·e^{−sₖ}`` ``[K]``."""
        return (self._factor * torch.exp(-self.log_vars)).detach().clone()

    @property
    def variances(self) -> Tensor:
        """``σₖ² = e^{sₖ}`` ``[K]``."""
        return torch.exp(self.log_vars.detach()).clone()

