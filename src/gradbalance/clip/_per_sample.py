"""Per-sample gradient clipping (DP-SGD) as task losses whose gradient is the clipped mean
(docs/loop.md, "Per-sample clipping")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn

from .._amp import all_finite, scale_of
from .._checks import (
    as_parameter_list,
    check_bool,
    check_generator,
    check_generator_state,
    check_int,
    check_norm_type,
    check_optional_int,
    check_positive,
)
from .._pickling import PicklableGenerators
from .._statedict import check_dict, check_keys
from .._types import NonFiniteGradientError
from ..balancers._rng import private_generator
from ._per_sample_func import per_sample_grad_norms_of_model
from ._per_sample_graph import _check_losses, per_sample_grad_norms
from ._task import norm_clip_coefficients

__all__ = ["PerSampleClip"]


def _check_finite_norms(norms: Tensor) -> None:
    """Without a scaler a non-finite per-sample norm raises (nothing is clipped)."""
    if not bool(torch.isfinite(norms).all()):
        bad = torch.nonzero(~torch.isfinite(norms)).tolist()
        raise NonFiniteGradientError(
            f"per-sample gradients hold inf or NaN (samples {bad[:8]}); nothing was "
            f"clipped. Skip this step or find the source of the overflow"
        )


class PerSampleClip(PicklableGenerators):
    """Clips every sample's gradient to ``max_norm`` before the batch mean (DP-SGD's clip).

    Abadi et al. (2016), "Deep Learning with Differential Privacy", Algorithm 1:
    ``ĝ = (1/B) Σᵢ cᵢ ∇ℓᵢ`` with ``cᵢ = min(1, C / (‖∇ℓᵢ‖ + 1e-6))``, constants of the step:
    the returned task losses have the batch mean as value and ĝ as gradient. The norms come
    from the graph (any model, cost in B²), ``GhostNorms`` or :meth:`losses_of_model`
    (docs/loop.md, "Per-sample clipping").

    Args:
        max_norm: C, the bound on each per-sample gradient's norm.
        norm_type: the p of the p-norm (``float('inf')`` allowed).
        per_task: with ``[B, K]`` losses, clip each (sample, task) gradient (True) or each
            sample's summed gradient over its K tasks (False).
        noise_multiplier: σ for :meth:`add_noise_` (0: no noise).
        generator: the noise's random source; default a private CPU generator seeded from
            torch's global RNG. It is saved by :meth:`state_dict`.
        chunk_size: rows per batched backward (see :func:`per_sample_grad_norms`).

    ``last_norms`` holds the pre-clip per-sample norms of the latest call (for logging).

    Example:
        >>> import torch
        >>> from gradbalance.clip import PerSampleClip
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> x = torch.tensor([[3.0, 4.0], [0.0, 0.5]])  # sample gradients, norms 5 and 0.5
        >>> PerSampleClip(max_norm=1.0)(x @ w, [w]).backward()
        >>> w.grad  # the mean of [0.6, 0.8] (clipped to norm 1) and [0, 0.5]
        tensor([0.3000, 0.6500])
    """

    def __init__(self, max_norm: float, *, norm_type: float = 2.0, per_task: bool = True,
                 noise_multiplier: float = 0.0, generator: torch.Generator | None = None,
                 chunk_size: int | None = None) -> None:
        self.max_norm = check_positive("max_norm", max_norm)
        self.norm_type = check_norm_type("norm_type", norm_type)
        self.per_task = check_bool("per_task", per_task)
        self.noise_multiplier = check_positive("noise_multiplier", noise_multiplier,
                                               allow_zero=True)
        self.generator = check_generator("generator", generator) or private_generator()
        self.chunk_size = check_optional_int("chunk_size", chunk_size, 1)
        self.last_norms: Tensor | None = None

    def factors(self, norms: Tensor) -> Tensor:
        """``min(1, C / (norm + 1e-6))``; 1 where a norm is not finite (the step is skipped)."""
        return norm_clip_coefficients(norms, self.max_norm)

    def __call__(self, per_sample_losses: Tensor, params: Iterable[Tensor],
                 scaler: Any = None, *, norms: Tensor | None = None) -> Tensor:
        """Task losses ``[K]`` (0-d for ``[B]`` input): the batch-mean value, the clipped gradient.

        ``params``: the parameters bounded. With an enabled ``GradScaler`` the norms are
        unscaled and a non-finite one leaves its sample unclipped (the scaler skips the step);
        without one it raises ``NonFiniteGradientError``. ``norms``: measured elsewhere.
        """
        losses = _check_losses(per_sample_losses)
        scale = scale_of(scaler, losses.device)
        if norms is None:
            norms = per_sample_grad_norms(losses, params, norm_type=self.norm_type,
                                          per_task=self.per_task, chunk_size=self.chunk_size,
                                          scale=1.0 if scale is None else scale)
        else:
            norms = self._given_norms(norms, losses)
        self.last_norms = norms.detach()
        if scale is None:
            _check_finite_norms(norms)
        coef = self.factors(norms).to(losses.dtype)
        if coef.dim() < losses.dim():  # per_task=False: one factor per sample
            coef = coef.unsqueeze(1)
        plain = losses.mean(dim=0)
        clipped = (coef.detach() * losses).mean(dim=0)
        return plain.detach() + (clipped - clipped.detach())

    def _given_norms(self, norms: object, losses: Tensor) -> Tensor:
        """``norms`` passed by the caller, with the shape the losses need (``[B]`` and
        ``[B, 1]`` alike for one task)."""
        expected = losses.shape if self.per_task or losses.dim() == 1 else losses.shape[:1]
        if isinstance(norms, Tensor) and norms.numel() == expected.numel():
            norms = norms.reshape(expected)
        if not isinstance(norms, Tensor) or norms.shape != expected:
            found = tuple(norms.shape) if isinstance(norms, Tensor) else type(norms).__name__
            raise ValueError(
                f"norms must have shape {tuple(expected)} (per_task={self.per_task}, losses "
                f"{tuple(losses.shape)}), got {found}"
            )
        return norms

    def losses_of_model(self, module: nn.Module, loss_fn: Callable[[Any, Tensor], Tensor],
                        inputs: Tensor, targets: Tensor, scaler: Any = None,
                        params: Iterable[Tensor] | None = None) -> Tensor:
        """The forward, the per-sample norms from the model (linear in B) and the clip.

        ``per_sample = loss_fn(module(inputs), targets)`` (``[B]`` or ``[B, K]``), the norms of
        :func:`per_sample_grad_norms_of_model` over ``params`` (default: every trainable one);
        returns the task losses of :meth:`__call__`.
        """
        per_sample = loss_fn(module(inputs), targets)
        scale = scale_of(scaler, inputs.device)
        norms = per_sample_grad_norms_of_model(
            module, loss_fn, inputs, targets, params=params, norm_type=self.norm_type,
            per_task=self.per_task, chunk_size=self.chunk_size,
            scale=1.0 if scale is None else float(scale))
        return self(per_sample, (), scaler, norms=norms)  # the norms given: no params read

    def add_noise_(self, params: Iterable[Tensor], batch_size: int) -> bool:
        """``.grad += N(0, (σ·C/batch_size)²)`` on every parameter with a ``.grad``.

        Once per optimizer step on the finished, unscaled gradients; ``batch_size``: the
        samples of the whole step. Returns False, touching neither ``.grad`` nor the generator,
        when a gradient is not finite or σ = 0.
        """
        check_int("batch_size", batch_size, 1)
        grads = [p.grad for p in as_parameter_list("params", params) if p.grad is not None]
        if self.noise_multiplier == 0.0 or not grads:
            return False
        if not all_finite(grads):
            return False
        std = self.noise_multiplier * self.max_norm / batch_size
        for g in grads:
            noise = torch.randn(g.shape, generator=self.generator, dtype=torch.float32)
            g.add_(noise.to(device=g.device, dtype=g.dtype), alpha=std)
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state().clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; ``ValueError``, the generator unchanged, for other
        keys or a state this generator cannot take."""
        name = type(self).__name__
        check_dict(name, state_dict)
        check_keys(name, state_dict, ["generator"], kind="clipper")
        if "generator" not in state_dict:
            raise ValueError(f"{name} state_dict lacks 'generator'; pass the output of "
                             f"{name}.state_dict()")
        saved = check_generator_state(name, state_dict["generator"], self.generator.device)
        self.generator.set_state(saved.clone())

    def __repr__(self) -> str:
        return (f"PerSampleClip(max_norm={self.max_norm}, norm_type={self.norm_type}, "
                f"per_task={self.per_task}, noise_multiplier={self.noise_multiplier})")
