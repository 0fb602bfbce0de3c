"""Nash-MTL: the Nash bargaining solution between the tasks."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from .._checks import check_choice, check_int, check_square
from ._base import Balancer
from ._solvers import nash_bargaining, trace_normalized

__all__ = ["NashMTL", "nashmtl_weights"]

Normalization = Literal["none", "frobenius"]
NoSolution = Literal["ridge", "raise"]


def nashmtl_weights(gramian: Tensor, normalization: Normalization = "none",
                    alpha0: Tensor | None = None,
                    no_solution: NoSolution = "ridge") -> tuple[Tensor, Tensor]:
    """``(weights, α_unit)``: Nash-MTL weights ``[K]`` and the warm-start state.

    ``α_unit`` solves ``(G/tr G) α = 1/α``; the weights solve ``(G/n) α = 1/α`` with ``n = 1``
    (``"none"``, the paper) or ``n = ‖G‖_F`` (``"frobenius"``, the authors' code and
    TorchJD), i.e. ``α = α_unit √(n / tr G)`` since ``α(G/s) = √s α(G)``. Where no solution
    exists, ``no_solution`` chooses a warning and the ridge's solution or a ``SolverError``
    (:class:`NashMTL`).

    Example:
        >>> import torch
        >>> from gradbalance.functional import nashmtl_weights
        >>> weights, _ = nashmtl_weights(torch.diag(torch.tensor([1.0, 4.0], dtype=torch.float64)))
        >>> weights
        tensor([1.0000, 0.5000], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    unit, trace = trace_normalized(gramian)
    alpha = nash_bargaining(unit, alpha0, no_solution=no_solution)
    return alpha * _factor(unit, trace, normalization), alpha


def _factor(unit: Tensor, trace: Tensor, normalization: str) -> Tensor:
    """``√(n / tr G)``: maps ``α`` of the trace-normalised Gramian to the weights."""
    if float(trace) <= 0.0:
        return torch.ones((), dtype=torch.float64)
    if normalization == "frobenius":
        norm: Tensor = torch.linalg.matrix_norm(unit)
        return norm.sqrt()
    return trace.rsqrt()


class NashMTL(Balancer):
    """Nash-MTL (Navon et al. 2022): ``g = Σₖ αₖ gₖ`` with ``αₖ (gₖ·g) = 1``.

    Every task gets ``gₖ·g = 1/αₖ``: the bargaining solution maximises ``Σ log(gₖ·d)`` over
    the ball ``‖d‖ ≤ 1`` (up to scale). Solved by damped Newton with a warm start from the
    previous step. No solution exists when a non-negative combination of the non-zero
    gradients vanishes (two exactly opposite gradients; K rows in random directions of an
    ``r``-dimensional span with probability ``1 − 2^{1−K} Σ_{i<r} C(K−1, i)``, Wendel 1962:
    near 1 once K is well above ``2r``, as at large K; rows sharing a direction can keep a
    solution in fewer dimensions): then it warns (``RuntimeWarning``) and solves
    ``(G + εI) α = 1/α``, ``ε = 1e-6 tr G``, as if every gradient had a private
    coordinate ``√ε`` (the update stays bounded: ``αᵀGα ≤ K``), or raises ``SolverError``
    with ``no_solution="raise"``. A zero gradient gets weight 0.

    Cost in K: damped Newton, ``O(K³)`` per step (at most 100 steps; from 512 tasks on the
    CPU a blocked Cholesky factorisation of the Hessian, else an LU solve), besides the
    Gramian ``O(K²P)``.

    Args:
        normalization: ``"none"`` (paper) or ``"frobenius"`` (authors' code: ``G/‖G‖_F``,
            then the update scales with the gradients).
        update_weights_every: solve every N-th call and reuse ``α`` in between (authors'
            option; default 1): the solution on the trace-normalised Gramian ``G/tr G``,
            mapped to the current call's scale (``α √(n / tr G)``, ``n`` as below), so the
            weights in between follow the gradients' size, where the authors' code keeps
            the last weights as they are (0.4 % apart on rows that move by half their norm).
        no_solution: ``"ridge"`` (default: warn, solve the ridge's equation) or ``"raise"``
            (``SolverError``, nothing moved) where the bargaining equation has no solution.

    Reference: Navon et al., "Multi-Task Learning as a Bargaining Game", ICML 2022,
    arXiv:2202.01017, Algorithm 1 (solved exactly here).

    Example:
        >>> import torch
        >>> from gradbalance.balancers import NashMTL
        >>> g = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=torch.float64)
        >>> NashMTL()(g)  # w = (1, 1/2) solves diag(1, 4) w = 1/w
        tensor([1.0000, 1.0000], dtype=torch.float64)
    """

    alpha: Tensor | None
    step: Tensor

    name = "nashmtl"
    inverts_gramian = True
    _repr_args = ("num_tasks", "normalization", "update_weights_every", "no_solution")
    from_gramian = True
    homogeneous = False

    def __init__(self, num_tasks: int | None = None, *,
                 normalization: Normalization = "none", update_weights_every: int = 1,
                 no_solution: NoSolution = "ridge") -> None:
        super().__init__(num_tasks)
        check_choice("normalization", normalization, ("none", "frobenius"))
        check_choice("no_solution", no_solution, ("ridge", "raise"))
        self.no_solution: NoSolution = no_solution
        self.update_weights_every = check_int("update_weights_every", update_weights_every, 1)
        self.normalization: Normalization = normalization
        self.homogeneous = normalization == "frobenius"
        # w(cG) = w(G)/√c (paper) or w(G) ("frobenius"): the solve sees G / maxₖ Gₖₖ.
        self.weight_degree = 0.0 if normalization == "frobenius" else -0.5
        self.register_state("alpha", None, optional=True, per_task=True)
        self.register_state("step", torch.zeros((), dtype=torch.int64))

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        k = gramian.shape[0]
        warm = self.alpha if self.alpha is not None and self.alpha.numel() == k else None
        unit, trace = trace_normalized(gramian)
        if warm is not None and int(self.step) % self.update_weights_every != 0:
            alpha_unit = warm
        else:
            # SolverError (no_solution="raise"): nothing has moved
            alpha_unit = nash_bargaining(unit, warm, no_solution=self.no_solution)
        w = alpha_unit * _factor(unit, trace, self.normalization)
        if self.num_tasks is None:
            self.num_tasks = k  # the warm start is per task: K is fixed from now on
        self.alpha = alpha_unit.clone()
        self.step = self.step + 1
        return w.to(gramian.device)

    def _load_extra(self, extra: dict[str, Any]) -> None:
        self.learned_num_tasks(self.alpha)
