"""STCH: smooth Tchebycheff scalarisation of the task losses (Lin et al., 2024)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._checks import (
    check_int,
    check_nonnegative_losses,
    check_positive,
    real_values,
    task_value_vectors,
)
from ._base import LossWeighting, times_weights

__all__ = ["STCH", "stch_weights"]


def stch_weights(losses: Tensor, nadir: Tensor, mu: float, preference: Tensor,
                 eps: float = 1e-20) -> Tensor:
    """Weights ``[K]`` whose ``Σₖ wₖ ∇Lₖ`` is the gradient of the STCH objective.

    Objective ``g = K·μ·log Σₖ exp(λₖ fₖ / μ)`` with ``fₖ = log(Lₖ/nₖ + eps)``, so
    ``wₖ = K·softmax(λ f / μ)ₖ · λₖ / (Lₖ + eps·nₖ)``. As ``μ → 0`` the weight goes to the
    task with the largest ``λₖ fₖ`` (Tchebycheff); a large ``μ`` spreads it evenly.

    Example:
        >>> import torch
        >>> from gradbalance.functional import stch_weights
        >>> losses = torch.tensor([1.0, 2.0])
        >>> stch_weights(losses, losses, mu=1.0, preference=torch.ones(2))  # at the nadir: 1/Lₖ
        tensor([1.0000, 0.5000], dtype=torch.float64)
    """
    x, n, lam = task_value_vectors(("losses", losses), ("nadir", nadir),
                                   ("preference", preference))
    check_nonnegative_losses("losses", x, "stch_weights")
    check_positive("mu", mu)
    check_positive("eps", eps)
    f = torch.log(x / n + eps)
    soft = torch.softmax(lam * f / mu, dim=0)
    return x.shape[0] * soft * lam / (x + eps * n)


class STCH(LossWeighting):
    """Smooth Tchebycheff scalarisation: minimise a smooth max of the normalised log-losses.

    ``g(L) = K·μ·log Σₖ exp(λₖ·log(Lₖ/nₖ)/μ)``, ``n`` the nadir (reference) losses. During
    the first ``warmup_steps`` optimizer steps the objective is ``Σₖ log Lₖ`` and the mean of
    those steps' losses becomes the nadir; with ``warmup_steps=0`` and no nadir, ``n = 1``.
    Returns ``wₖ Lₖ`` with detached weights (:func:`stch_weights`). Losses must be >= 0.

    Args:
        mu: smoothing ``μ > 0``.
        warmup_steps: optimizer steps used to estimate the nadir.
        nadir: reference losses ``[K]`` (> 0), instead of the warm-up estimate.
        preference: ``λ`` ``[K]`` (> 0, default ones).

    Reference: Lin et al., "Smooth Tchebycheff Scalarization for Multi-Objective
    Optimization", ICML 2024.

    Example:
        >>> import torch
        >>> from gradbalance.weighting import STCH
        >>> stch = STCH(2, nadir=[1.0, 2.0])
        >>> stch(torch.tensor([1.0, 2.0])), stch.weights  # at the nadir: wₖ = 1/Lₖ
        (tensor([1., 1.]), tensor([1.0000, 0.5000], dtype=torch.float64))
    """

    name = "stch"
    reads_losses = True
    _weights_state = "_last"
    preference: Tensor
    _nadir: Tensor | None
    _warmup_sum: Tensor
    _last: Tensor
    _steps: Tensor

    def __init__(self, num_tasks: int, *, mu: float = 1.0, warmup_steps: int = 0,
                 nadir: Sequence[float] | Tensor | None = None,
                 preference: Sequence[float] | Tensor | None = None, eps: float = 1e-20,
                 device: torch.device | str | None = None) -> None:
        super().__init__(num_tasks, device=device)
        self.mu = check_positive("mu", mu)
        self.eps = check_positive("eps", eps)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0)
        self.register_buffer("preference", self._vector(preference, "preference"),
                             persistent=False)
        k, dev = num_tasks, self.device
        nadir_0 = (self._vector(nadir, "nadir") if nadir is not None
                   else torch.ones(k, dtype=torch.float64, device=dev) if warmup_steps == 0
                   else None)
        self.register_state("_nadir", nadir_0, optional=True, shape=(k,), per_task=True)
        self.register_state("_warmup_sum", torch.zeros(k, dtype=torch.float64, device=dev),
                            per_task=True)
        self.register_state("_last", torch.ones(k, dtype=torch.float64, device=dev),
                            per_task=True, persistent=False)
        self.register_state("_steps", torch.zeros((), dtype=torch.int64, device=dev))

    def _vector(self, value: Sequence[float] | Tensor | None, argname: str) -> Tensor:
        k = self.num_tasks
        if value is None:
            return torch.ones(k, dtype=torch.float64, device=self.device)
        v = real_values(argname, value).to(self.device)
        if v.shape != (k,) or not bool(torch.isfinite(v).all()) or not bool((v > 0).all()):
            raise ValueError(f"Invalid {argname}: {v.tolist()} (expected {k} finite numbers "
                             f"> 0, one per task)")
        return v

    @property
    def in_warmup(self) -> bool:
        return self._nadir is None

    @property
    def nadir(self) -> Tensor | None:
        """The reference losses ``[K]`` (None while being estimated)."""
        return None if self._nadir is None else self._nadir.clone()

    def _weighted(self, losses: Tensor) -> Tensor:
        check_nonnegative_losses("losses", losses, "STCH")
        if self._nadir is None:
            w = 1.0 / (losses.detach().double().to(self.device) + self.eps)
        else:
            w = stch_weights(losses.to(self.device), self._nadir, self.mu, self.preference,
                             self.eps)
        self._last = w
        return times_weights(w, losses)

    def _apply_update(self, losses: Tensor, losses_after: Tensor | None) -> None:
        self._steps = self._steps + 1
        if self._nadir is None:
            self._warmup_sum = self._warmup_sum + losses
            if int(self._steps) >= self.warmup_steps:
                nadir = self._warmup_sum / self._steps
                self._nadir = nadir.clamp_min(torch.finfo(torch.float64).tiny)
