"""AutoClip: a clipping threshold that adapts to the run's own gradient norms.

Seetharaman et al. (2020), "AutoClip: Adaptive Gradient Clipping for Source Separation
Networks", MLSP. At step t the threshold is the p-th percentile of the norms seen so far,
including the current one:

    τₜ = percentile_p({‖g_s‖ : s ≤ t, healthy}),   g ← g · min(1, τₜ / (‖g‖ + 1e-6))

Here the history is bounded (the last ``history_size`` healthy norms, a ring buffer) and
non-finite norms never enter it; a step with a non-finite norm changes no state and clips
nothing (a GradScaler skips it). The percentile uses linear interpolation, as
``numpy.percentile``'s default. Reading the finiteness costs one host sync per call.

:func:`suggest_max_norm` is the offline version (docs/loop.md, "Clipping"): log the pre-clip
norms of an unclipped run and set ``max_norm`` near their 90th–95th percentile.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._checks import (
    check_int,
    check_matrix,
    check_norm_type,
    check_positive_int,
    check_range,
)
from .._statedict import check_keys, tag_state, untag_state
from .._types import NonFiniteGradientError
from ._params import params_with_grads
from ._task import _EPS, row_norms

__all__ = ["AutoClip", "TaskAutoClip", "suggest_max_norm"]


def suggest_max_norm(norms: Sequence[float] | Tensor, percentile: float = 95.0) -> float:
    """A ``max_norm`` from logged pre-clip norms: their ``percentile``-th percentile.

    The rule of docs/loop.md ("Clipping"): run without clipping for a while, log the norms,
    and set the limit around the 90th–95th percentile of the healthy values, so that clipping
    catches runaways instead of leaning on every step. Non-finite entries are ignored.

    Example:
        >>> from gradbalance.clip import suggest_max_norm
        >>> suggest_max_norm([1.0, 2.0, 3.0, 4.0, 5.0], percentile=50)
        3.0
    """
    p = check_range("percentile", percentile, 0, 100)
    values = torch.as_tensor(norms, dtype=torch.float64).detach().reshape(-1).cpu()
    healthy = values[torch.isfinite(values)]
    if healthy.numel() == 0:
        raise ValueError(
            f"norms holds no finite value ({values.numel()} entries); log the pre-clip norms "
            f"of some healthy steps first"
        )
    return float(torch.quantile(healthy, p / 100))


_HISTORY_KEYS = ("history", "count", "position", "threshold")


class _PercentileHistory:
    """Ring buffer of the last ``size`` healthy norm vectors ``[C]``, float64."""

    def __init__(self, percentile: float, history_size: int) -> None:
        self.history_size = check_positive_int("history_size", history_size, ", e.g. 1000")
        self.percentile = check_range("percentile", percentile, 0, 100)
        self.reset()

    def reset(self) -> None:
        self.history: Tensor | None = None  # [history_size, C]
        self.count = 0  # healthy norms seen (the buffer holds the last min(count, size))
        self.position = 0
        self.threshold: Tensor | None = None

    def observe(self, norms: Tensor) -> Tensor | None:
        """Add finite ``norms`` ``[C]`` and return the threshold ``[C]``; None if non-finite."""
        if not bool(torch.isfinite(norms).all()):
            return None
        values = norms.detach().to(torch.float64)
        if self.history is None or self.history.shape[1] != values.numel():
            if self.history is not None and self.count > 0:
                raise ValueError(
                    f"got {values.numel()} norms but the history holds "
                    f"{self.history.shape[1]} per step; use one clipper per set of tasks"
                )
            self.history = torch.zeros(
                self.history_size, values.numel(), dtype=torch.float64, device=values.device
            )
        self.history[self.position].copy_(values)
        self.position = (self.position + 1) % self.history_size
        self.count += 1
        filled = self.history[: min(self.count, self.history_size)]
        self.threshold = torch.quantile(filled, self.percentile / 100, dim=0)
        return self.threshold

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": None if self.history is None else self.history.clone(),
            "count": self.count,
            "position": self.position,
            "threshold": None if self.threshold is None else self.threshold.clone(),
        }

    def load_state_dict(self, state: dict[str, Any], owner: str) -> None:
        missing = {"history", "count", "position", "threshold"} - set(state)
        if missing:
            raise ValueError(
                f"state_dict lacks {sorted(missing)}; pass the output of {owner}.state_dict()"
            )
        history, threshold = state["history"], state["threshold"]
        count = check_int("state_dict['count']", state["count"], 0)
        position = check_int("state_dict['position']", state["position"], 0)
        self._check_history(history, count, owner)
        columns = None if history is None else history.shape[1]
        _check_norms("threshold", threshold, columns, owner)
        if position != count % self.history_size:
            raise ValueError(
                f"state_dict position={position} does not follow count={count} with "
                f"history_size={self.history_size}; pass the output of {owner}.state_dict()"
            )
        self.history = None if history is None else history.clone()
        self.count, self.position = count, position
        self.threshold = None if threshold is None else threshold.clone()

    def _check_history(self, history: Any, count: int, owner: str) -> None:
        """Raise ``ValueError`` unless ``history`` is finite ``[history_size, C]`` (C: the
        number of norms this history tracks now, if it tracks any), or None before any."""
        if history is None:
            if count:
                raise ValueError(f"state_dict count={count} but no history; pass the output "
                                 f"of {owner}.state_dict()")
            return
        if not isinstance(history, Tensor) or history.dim() != 2 \
                or history.shape[0] != self.history_size:
            shape = tuple(history.shape) if isinstance(history, Tensor) else type(history)
            raise ValueError(
                f"state_dict history has shape {shape} but this {owner} keeps "
                f"history_size={self.history_size} rows; build it with the saved history_size"
            )
        tracked = self.history.shape[1] if self.history is not None and self.count else None
        _check_norms("history", history, tracked, owner)


def _check_norms(key: str, value: Any, columns: int | None, owner: str) -> None:
    """Raise ``ValueError`` unless ``value`` (None, or norms ``[..., C]``) is finite with
    ``columns`` norms per step (where known)."""
    if value is None:
        return
    if not isinstance(value, Tensor) or not value.is_floating_point() or value.dim() == 0:
        raise ValueError(f"state_dict[{key!r}] must be a floating tensor of norms, got "
                         f"{type(value).__name__}; pass the output of {owner}.state_dict()")
    if columns is not None and value.shape[-1] != columns:
        raise ValueError(f"state_dict[{key!r}] has {value.shape[-1]} norms per step but "
                         f"{owner} tracks {columns} (one per task or clipped group); load a "
                         f"state saved with the same tasks, or call reset() first")
    if not bool(torch.isfinite(value).all()):
        raise ValueError(f"state_dict[{key!r}] holds inf/NaN; load an earlier checkpoint, or "
                         f"call reset() instead")


class _AutoBase:
    def __init__(self, percentile: float, history_size: int, norm_type: float,
                 error_if_nonfinite: bool) -> None:
        self._history = _PercentileHistory(percentile, history_size)
        self.norm_type = check_norm_type("norm_type", norm_type)
        self.error_if_nonfinite = error_if_nonfinite

    @property
    def percentile(self) -> float:
        return self._history.percentile

    @property
    def history_size(self) -> int:
        return self._history.history_size

    @property
    def history(self) -> Tensor:
        """The healthy norms kept, oldest first ``[n, C]`` (n ≤ history_size)."""
        h = self._history
        if h.history is None:
            return torch.zeros(0, 1, dtype=torch.float64)
        if h.count < h.history_size:
            return h.history[: h.count].clone()
        return torch.roll(h.history, -h.position, dims=0)

    @property
    def threshold(self) -> Tensor | None:
        """The threshold used by the last healthy call, or None before any."""
        return self._history.threshold

    def state_dict(self) -> dict[str, Any]:
        return tag_state(self, self._history.state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = untag_state(self, state_dict, "clipper")  # AutoClip's and TaskAutoClip's
        check_keys(type(self).__name__, state, _HISTORY_KEYS, "clipper")  # keys coincide
        self._history.load_state_dict(state, type(self).__name__)

    def reset(self) -> None:
        self._history.reset()

    def _nonfinite(self, norms: Tensor) -> NonFiniteGradientError:
        return NonFiniteGradientError(
            f"pre-clip norm {norms.tolist()} is not finite; {type(self).__name__} clipped "
            f"nothing and its history is unchanged. Skip this step"
        )

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(percentile={self.percentile}, "
                f"history_size={self.history_size}, norm_type={self.norm_type})")


class AutoClip(_AutoBase):
    """AutoClip on parameters, used like ``torch.nn.utils.clip_grad_norm_``.

    ``clipper(model.parameters())`` clips the total gradient norm to the ``percentile``-th
    percentile of the last ``history_size`` healthy norms (the current one included) and
    returns the pre-clip total norm. Under AMP call it after ``scaler.unscale_(optimizer)``.

    Args:
        percentile: p in [0, 100]; the paper's recommended value is 10.
        history_size: how many healthy norms to remember.
        norm_type: the p of the p-norm.
        error_if_nonfinite: raise on a non-finite norm instead of returning it.
    """

    def __init__(self, percentile: float = 10.0, history_size: int = 1000,
                 norm_type: float = 2.0, error_if_nonfinite: bool = False) -> None:
        super().__init__(percentile, history_size, norm_type, error_if_nonfinite)

    def __call__(self, parameters: Iterable[Tensor] | Tensor) -> Tensor:
        grads = [p.grad for p in params_with_grads(parameters) if p.grad is not None]
        if not grads:
            return torch.zeros(())
        device = grads[0].device
        norms = torch.stack([
            torch.linalg.vector_norm(g.detach(), self.norm_type).to(device) for g in grads
        ])
        total: Tensor = torch.linalg.vector_norm(norms, self.norm_type)
        threshold = self._history.observe(total.reshape(1))
        if threshold is None:
            if self.error_if_nonfinite:
                raise self._nonfinite(total.reshape(1))
            return total
        coef = (threshold[0] / (total.double() + _EPS)).clamp(max=1.0)
        for g in grads:
            g.detach().mul_(coef.to(device=g.device, dtype=g.dtype))
        return total


class TaskAutoClip(_AutoBase):
    """AutoClip per task on the rows of ``G``: a ``RowClipper`` for ``apply_(clip=...)``.

    Each task keeps its own history; row ``k`` is clipped to the ``percentile``-th percentile
    of task ``k``'s last ``history_size`` healthy norms. Returns the pre-clip row norms ``[K]``.
    """

    def __init__(self, percentile: float = 10.0, history_size: int = 1000,
                 norm_type: float = 2.0, error_if_nonfinite: bool = False) -> None:
        super().__init__(percentile, history_size, norm_type, error_if_nonfinite)

    def __call__(self, matrix: Tensor) -> Tensor:
        check_matrix("matrix", matrix)
        norms = row_norms(matrix, self.norm_type)
        matrix.mul_(self.coefficients(norms).to(matrix.dtype).unsqueeze(1))
        return norms

    def coefficients(self, norms: Tensor) -> Tensor:
        """The factor ``cₖ`` each row is multiplied by, from its pre-clip norm ``[K]``; the
        norms join the history (a non-finite set is not recorded and clips nothing)."""
        threshold = self._history.observe(norms)
        if threshold is None:
            if self.error_if_nonfinite:
                raise self._nonfinite(norms)
            return torch.ones_like(norms, dtype=torch.float64)
        return (threshold / (norms.double() + _EPS)).clamp(max=1.0)


