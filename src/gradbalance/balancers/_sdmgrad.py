"""SDMGrad: stochastic direction-oriented multi-objective gradient descent."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .._checks import as_task_vector, check_int, check_range, check_square
from ._base import Balancer
from ._mean import mean_weights
from ._solvers import project_simplex

__all__ = ["SDMGrad", "sdmgrad_weights"]


def sdmgrad_weights(gramian: Tensor, w: Tensor, pref: Tensor, lambda_: float = 0.3,
                    lr: float = 5.0, momentum: float = 0.5,
                    n_iter: int = 20) -> tuple[Tensor, Tensor]:
    """SDMGrad's inner solve; returns (final weights ``[K]``, new simplex iterate ``w``).

    ``A = G Gᵀ / s²``, ``s = mean(√diag(G Gᵀ))`` (scale-free). Then ``n_iter`` steps of SGD with
    heavy-ball momentum (fresh buffer each call) on ``½‖Gᵀ(w + λ w̃)‖²`` over the simplex:
    ``v ← μ v + A (w + λ w̃)``, ``w ← Π_Δ(w − lr · v)``. Output weights ``(w + λ w̃)/(1 + λ)``
    (the update ``g = Gᵀ(w + λ w̃)/(1 + λ)``, direction-oriented towards ``g₀ = Gᵀ w̃``).

    Example:
        >>> import torch
        >>> from gradbalance.functional import sdmgrad_weights
        >>> third = torch.full((3,), 1 / 3, dtype=torch.float64)
        >>> weights, _ = sdmgrad_weights(torch.eye(3, dtype=torch.float64), third, third)
        >>> weights  # uniform by symmetry
        tensor([0.3333, 0.3333, 0.3333], dtype=torch.float64)
    """
    check_square("gramian", gramian)
    diag = torch.diagonal(gramian).clamp_min(0)
    scale = diag.sqrt().mean() ** 2
    a = gramian / scale if bool(scale > 0) else gramian
    velocity: Tensor | None = None
    for _ in range(n_iter):
        grad = a @ (w + lambda_ * pref)
        velocity = grad if velocity is None else momentum * velocity + grad
        w = project_simplex(w - lr * velocity)
    return (w + lambda_ * pref) / (1.0 + lambda_), w


class SDMGrad(Balancer):
    """``g = Σₖ (wₖ + λ w̃ₖ)/(1 + λ) gₖ`` with ``w`` from a warm-started simplex SGD.

    Cost in K: Gramian–vector products ``O(K²)`` per inner step and a simplex projection ``O(K
    log K)``, besides the Gramian ``O(K²P)``.

    Args:
        lambda_: pull ``λ ≥ 0`` towards the preference direction (default 0.3, the official
            experiments and LibMTL).
        lr: step size of the inner SGD (default 5.0: LibMTL / the official code).
        momentum: momentum of the inner SGD (default 0.5).
        n_iter: iterations of the inner SGD (default 20).
        pref_vector: ``w̃`` (default uniform ``1/K``: the mean gradient).

    Reference: Xiao et al., "Direction-oriented Multi-objective Learning: Simple and Provable
    Stochastic Algorithms", NeurIPS 2023, arXiv:2305.18409, Algorithm 1.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import SDMGrad
        >>> SDMGrad()(torch.eye(3, dtype=torch.float64))  # uniform by symmetry
        tensor([0.3333, 0.3333, 0.3333], dtype=torch.float64)
    """

    _w: Tensor | None

    name = "sdmgrad"
    _repr_args = ("num_tasks", "lambda_", "lr", "momentum", "n_iter")
    from_gramian = True
    homogeneous = True
    weight_degree = 0.0  # A is normalised by mean √diag: the simplex iterate is scale-free

    def __init__(self, num_tasks: int | None = None, lambda_: float = 0.3, lr: float = 5.0,
                 momentum: float = 0.5, n_iter: int = 20,
                 pref_vector: Sequence[float] | Tensor | None = None) -> None:
        pref = None
        if pref_vector is not None:
            pref = as_task_vector("pref_vector", pref_vector, num_tasks)
            num_tasks = pref.numel()
        super().__init__(num_tasks)
        self.lambda_ = check_range("lambda_", lambda_, 0.0, None)
        self.lr = check_range("lr", lr, 0.0, None, low_open=True)
        self.momentum = check_range("momentum", momentum, 0.0, 1.0, high_open=True)
        self.n_iter = check_int("n_iter", n_iter, 1)
        self.pref_vector = pref
        self.register_state("_w", None, optional=True, per_task=True)

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        gram = gramian.to(torch.float64)
        w = mean_weights(gram) if self._w is None else self._w
        pref = mean_weights(gram) if self.pref_vector is None else self.pref_vector.to(gram.device)
        out, w = sdmgrad_weights(gram, w, pref, self.lambda_, self.lr, self.momentum,
                                 self.n_iter)
        self._w = w
        return out
