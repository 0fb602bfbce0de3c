"""AutoClip: a clipping threshold from a percentile of the run's own recent gradient norms,
on the parameters or per task, and its offline form :func:`suggest_max_norm`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .._checks import (
    check_bool,
    check_int,
    check_norm_type,
    check_positive_int,
    check_range,
    check_writable_rows,
)
from .._statedict import check_keys, tag_state, untag_state
from .._types import NonFiniteGradientError
from ._params import factor_for, params_with_grads, total_grad_norm
from ._task import norm_clip_coefficients, row_norms

__all__ = ["AutoClip", "TaskAutoClip", "suggest_max_norm"]

_STATE_KEYS = ("history", "count", "position", "threshold")


def suggest_max_norm(norms: Sequence[float] | Tensor, percentile: float = 95.0) -> float:
    """A ``max_norm`` from logged pre-clip norms: their ``percentile``-th percentile.

    The rule of docs/loop.md ("Clipping"); non-finite entries are ignored.

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


class _AutoBase:
    """The percentile threshold: a ring of the last ``history_size`` healthy norm sets ``[C]``
    (float64); a non-finite set is not recorded and clips nothing."""

    #: The norms per step (C), where fixed by the class (None: set by the first call).
    _columns: int | None = None

    def __init__(self, percentile: float = 10.0, history_size: int = 1000,
                 norm_type: float = 2.0, error_if_nonfinite: bool = False) -> None:
        self.history_size = check_positive_int("history_size", history_size, ", e.g. 1000")
        self.percentile = check_range("percentile", percentile, 0, 100)
        self.norm_type = check_norm_type("norm_type", norm_type)
        self.error_if_nonfinite = check_bool("error_if_nonfinite", error_if_nonfinite)
        self.reset()

    def reset(self) -> None:
        """Forget every norm seen."""
        self._ring: Tensor | None = None  # [history_size, C]
        self._count = 0  # healthy sets seen; the ring holds the last min(count, history_size)
        self._position = 0
        #: The threshold of the last healthy call ``[C]``, or None before any.
        self.threshold: Tensor | None = None

    @property
    def history(self) -> Tensor:
        """The healthy norms kept, oldest first ``[n, C]`` (n ≤ history_size)."""
        if self._ring is None:
            return torch.zeros(0, 1, dtype=torch.float64)
        if self._count < self.history_size:
            return self._ring[: self._count].clone()
        return torch.roll(self._ring, -self._position, dims=0)

    def _factors(self, norms: Tensor) -> Tensor | None:
        """Record ``norms`` ``[C]`` and return ``min(1, τ / (norm + 1e-6))``; None (nothing
        recorded) for a non-finite set, unless ``error_if_nonfinite`` raises."""
        if not bool(torch.isfinite(norms).all()):
            if self.error_if_nonfinite:
                raise NonFiniteGradientError(
                    f"pre-clip norm {norms.tolist()} is not finite; {type(self).__name__} "
                    f"clipped nothing and its history is unchanged. Skip this step"
                )
            return None
        values = norms.detach().to(torch.float64)
        if values.dim() != 1 or values.numel() == 0:
            raise ValueError(f"norms must be a non-empty 1-D tensor, one per row, got shape "
                             f"{tuple(values.shape)}; nothing was recorded")
        if self._ring is None or self._ring.shape[1] != values.numel():
            if self._ring is not None and self._count > 0:
                raise ValueError(
                    f"got {values.numel()} norms but the history holds "
                    f"{self._ring.shape[1]} per step, one per row (with batch_dim=0 each of "
                    f"the B·K per-sample objectives: a smaller last batch has fewer); use one "
                    f"clipper per set of rows, DataLoader(drop_last=True), or TaskClip"
                )
            self._ring = torch.zeros(self.history_size, values.numel(), dtype=torch.float64,
                                     device=values.device)
        self._ring[self._position].copy_(values)
        self._position = (self._position + 1) % self.history_size
        self._count += 1
        filled = self._ring[: min(self._count, self.history_size)]
        self.threshold = torch.quantile(filled, self.percentile / 100, dim=0)
        return norm_clip_coefficients(values, self.threshold)

    def state_dict(self) -> dict[str, Any]:
        return tag_state(self, {
            "history": None if self._ring is None else self._ring.clone(),
            "count": self._count,
            "position": self._position,
            "threshold": None if self.threshold is None else self.threshold.clone(),
        })

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output; ``ValueError``, nothing changed, for the state of
        another class or a history that does not fit this clipper."""
        name = type(self).__name__
        state = untag_state(self, state_dict, "clipper")  # AutoClip's and TaskAutoClip's
        check_keys(name, state, _STATE_KEYS, "clipper")  # keys coincide
        missing = set(_STATE_KEYS) - set(state)
        if missing:
            raise ValueError(
                f"state_dict lacks {sorted(missing)}; pass the output of {name}.state_dict()"
            )
        count = check_int("state_dict['count']", state["count"], 0)
        position = check_int("state_dict['position']", state["position"], 0)
        ring, threshold = state["history"], state["threshold"]
        self._check_history(ring, threshold, count)
        if position != count % self.history_size:
            raise ValueError(
                f"state_dict position={position} does not follow count={count} with "
                f"history_size={self.history_size}; pass the output of {name}.state_dict()"
            )
        self._ring = None if ring is None else ring.to(torch.float64, copy=True)  # as recorded
        self._count, self._position = count, position
        self.threshold = None if threshold is None else threshold.to(torch.float64, copy=True)

    def _check_history(self, ring: Any, threshold: Any, count: int) -> None:
        """``ValueError`` unless history and threshold are both unset (count 0, before any norm)
        or a finite ``[history_size, C]`` and ``[C]``, C the norms per step tracked (if any)."""
        if ring is None or threshold is None:
            if ring is not None or threshold is not None or count:
                raise ValueError(
                    f"state_dict has count={count}, history and threshold not all unset (before "
                    f"any norm) nor all set; pass the output of {type(self).__name__}.state_dict()"
                )
            return
        tracked = self._ring.shape[1] if self._ring is not None and self._count else None
        self._check_saved("history", ring, (self.history_size, self._columns or tracked))
        self._check_saved("threshold", threshold, (ring.shape[1],))

    def _check_saved(self, key: str, value: Any, shape: tuple[int | None, ...]) -> None:
        """``ValueError`` unless ``value`` is a finite floating tensor of ``shape`` (None: any
        size)."""
        name = type(self).__name__
        if not isinstance(value, Tensor) or not value.is_floating_point():
            found = (f"a tensor of dtype {value.dtype}" if isinstance(value, Tensor)
                     else f"a {type(value).__name__}")
            raise ValueError(f"state_dict[{key!r}] must be a floating tensor of norms, got "
                             f"{found}; pass the output of {name}.state_dict()")
        if value.dim() != len(shape) or any(
                n is not None and n != m for n, m in zip(shape, value.shape)):
            expected = tuple("C" if n is None else n for n in shape)
            raise ValueError(
                f"state_dict[{key!r}] has shape {tuple(value.shape)}, expected {expected} (this "
                f"{name} keeps history_size={self.history_size} steps of C norms, one per task "
                f"or clipped group); load a state saved with the same history_size and tasks, "
                f"or call reset() first"
            )
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"state_dict[{key!r}] holds inf/NaN; load an earlier checkpoint, "
                             f"or call reset() instead")
        if bool((value < 0).any()):
            raise ValueError(f"state_dict[{key!r}] holds negative norms "
                             f"({float(value.min())}); pass the output of {name}.state_dict()")

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(percentile={self.percentile}, "
                f"history_size={self.history_size}, norm_type={self.norm_type})")


class AutoClip(_AutoBase):
    """AutoClip on parameters, used like ``torch.nn.utils.clip_grad_norm_``.

    Seetharaman et al. (2020), "AutoClip: Adaptive Gradient Clipping for Source Separation
    Networks", MLSP. The threshold is the ``percentile``-th percentile (linear interpolation,
    as ``numpy.percentile``) of the last ``history_size`` healthy total norms, the current
    one included::

        τₜ = percentile_p({‖g_s‖ : s ≤ t, healthy}),   g ← g · min(1, τₜ / (‖g‖ + 1e-6))

    ``clipper(model.parameters())`` clips in place and returns the pre-clip total norm; a
    non-finite norm clips nothing and is not recorded (docs/loop.md, "Clipping").

    Args:
        percentile: p in [0, 100]; the paper's recommended value is 10.
        history_size: how many healthy norms to remember.
        norm_type: the p of the p-norm.
        error_if_nonfinite: raise on a non-finite norm instead of returning it.

    Example:
        >>> import torch
        >>> from gradbalance.clip import AutoClip
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> clip = AutoClip(percentile=0)  # the smallest norm seen so far
        >>> w.grad = torch.tensor([0.3, 0.4])
        >>> clip([w])  # the pre-clip norm (the first one is its own threshold)
        tensor(0.5000)
        >>> w.grad = torch.tensor([6.0, 8.0])
        >>> clip([w]), w.grad  # threshold min(0.5, 10): clipped to norm 0.5
        (tensor(10.), tensor([0.3000, 0.4000]))
    """

    _columns = 1  # the total norm

    def __call__(self, parameters: Iterable[Tensor] | Tensor) -> Tensor:
        grads = [p.grad for p in params_with_grads(parameters) if p.grad is not None]
        if not grads:
            return torch.zeros(())
        total = total_grad_norm(grads, self.norm_type)
        coef = self._factors(total.reshape(1))
        if coef is not None:
            with torch.no_grad():  # a sparse .grad itself: its detached copy holds its own values
                for g in grads:
                    (g if g.layout == torch.sparse_coo else g.detach()).mul_(factor_for(coef[0], g))
        return total


class TaskAutoClip(_AutoBase):
    """AutoClip per task on the rows of ``G``: a ``RowClipper`` for ``apply_(clip=...)``.

    Each task keeps its own history; row ``k`` is clipped to the ``percentile``-th percentile
    of task ``k``'s last ``history_size`` healthy norms (the rule and arguments of
    :class:`AutoClip`, per row). Returns the pre-clip row norms ``[K]``.

    Example:
        >>> import torch
        >>> from gradbalance.clip import TaskAutoClip
        >>> clip = TaskAutoClip(percentile=0)  # each task's smallest norm so far
        >>> clip(torch.tensor([[0.3, 0.4], [3.0, 4.0]]))  # the first norms: thresholds
        tensor([0.5000, 5.0000])
        >>> G = torch.tensor([[6.0, 8.0], [0.6, 0.8]])
        >>> clip(G), G  # row 0 clipped to its task's 0.5; row 1, its task's smallest, kept
        (tensor([10.,  1.]), tensor([[0.3000, 0.4000],
                [0.6000, 0.8000]]))
    """

    def __call__(self, matrix: Tensor) -> Tensor:
        check_writable_rows("matrix", matrix)
        norms = row_norms(matrix, self.norm_type)
        matrix.mul_(factor_for(self.coefficients(norms).unsqueeze(1), matrix))
        return norms

    def coefficients(self, norms: Tensor) -> Tensor:
        """The factor ``cₖ`` each row is multiplied by, from its pre-clip norm ``[K]``; the
        norms join the history (a non-finite set is not recorded and clips nothing)."""
        coef = self._factors(norms)
        return torch.ones_like(norms, dtype=torch.float64) if coef is None else coef
