"""GradVac: raise each pair's gradient cosine to an adaptive (EMA) target.

Wang et al. (2021), *Gradient Vaccine: Investigating and Improving Multi-task Optimization
in Massively Multilingual Models*, ICLR, arXiv:2010.05874, Algorithm 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._checks import check_generator, check_range, check_square
from .._shard import Shard
from ..gramian import compute_gramian
from ._base import Combination
from ._pairwise import coefficients, column_sums, pass_weights
from ._rng import OwnedGeneratorState, private_generator
from ._solvers import trace_normalized

__all__ = ["GradVac", "gradvac_coefficients", "gradvac_orders"]


def gradvac_orders(k: int, generator: torch.Generator | None = None) -> Tensor:
    """``[K, K-1]`` int64: row ``i`` is a random order of the tasks ``j ≠ i``.

    One ``torch.randperm(K-1)`` per task in task order (TorchJD's draw pattern).

    Example:
        >>> import torch
        >>> from gradbalance.functional import gradvac_orders
        >>> orders = gradvac_orders(3)
        >>> orders.shape, bool((orders != torch.arange(3)[:, None]).all())  # never itself
        (torch.Size([3, 2]), True)
    """
    if k == 0:
        return torch.zeros(0, 0, dtype=torch.int64)
    perms = torch.stack([torch.randperm(k - 1, generator=generator) for _ in range(k)])
    # Position p of the sorted others of task i holds p (p < i) or p + 1 (p ≥ i).
    return perms + (perms >= torch.arange(k)[:, None]).to(torch.int64)


def gradvac_coefficients(
    gramian: Tensor, orders: Tensor, targets: Tensor, beta: float, eps: float = 1e-8,
    max_step: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """``(C, new_targets)``: ``g_i^PC = Σⱼ C[i, j] gⱼ`` and the updated EMA targets ``[K, K]``.

    Update rule, for each task ``i`` and each ``j`` in ``orders[i]``:
    ``φ = cos(g_i^PC, gⱼ)``; if ``φ < φ̂ᵢⱼ``: ``g_i^PC += w gⱼ`` with

    ``w = min(‖g_i^PC‖ (φ̂ √(1−φ²) − φ √(1−φ̂²)) / (‖gⱼ‖ √(1−φ̂²)), ρ ‖gᵢ‖ / ‖gⱼ‖)``

    (the first term is the paper's closed form that makes the cosine exactly ``φ̂``;
    ``ρ = max_step``); then ``φ̂ᵢⱼ ← (1−β) φ̂ᵢⱼ + β φ``. ``eps`` is added to the two
    denominators (on the trace-normalised Gramian, so it is scale-free). All from the
    Gramian, vectorised over ``i`` (the blocked pass of
    :func:`~gradbalance.balancers._pairwise.pairwise_pass`, ``O(K³)``; ``‖g_i^PC‖²`` updated
    per visit). ``targets`` is not modified.

    Bound. With ``θ = arccos φ``, ``θ̂ = arccos φ̂`` the paper's step is
    ``w‖gⱼ‖ = ‖g_i^PC‖ sin(θ − θ̂) / sin θ̂ ≥ 0``: unbounded as ``φ̂ → 1`` (after colinear
    gradients, where it also divides rounding noise by rounding noise), and it compounds over
    the ``K − 1`` visits. The clamp gives ``w‖gⱼ‖ ≤ ρ‖gᵢ‖`` at every visit, so
    ``‖g_i^PC‖ ≤ ‖gᵢ‖ + Σ_visits w‖gⱼ‖ ≤ (1 + ρ(K−1)) ‖gᵢ‖`` and the update
    ``‖Σᵢ g_i^PC‖ ≤ (1 + ρ(K−1)) Σᵢ ‖gᵢ‖`` for every finite input (and every target): at
    most ``K`` task-gradient norms at ``ρ = 1``. When every target is ``≤ 0`` the clamp never
    binds at ``ρ = 1``: then ``θ − θ̂ ≤ π − θ̂ ≤ π/2`` gives ``sin(θ − θ̂) ≤ sin θ̂`` and
    ``sin θ ≤ sin θ̂``, so no visit grows ``‖g_i^PC‖ = ‖g_i^PC‖_before sin θ / sin θ̂`` past
    ``‖gᵢ‖`` (with zero targets this is PCGrad exactly).

    Example:
        >>> import torch
        >>> from gradbalance.functional import gradvac_coefficients, gradvac_orders
        >>> g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> c, targets = gradvac_coefficients(g @ g.T, gradvac_orders(2), torch.zeros(2, 2), 0.5)
        >>> c, targets  # zero targets: PCGrad's C; new targets β·cos = ½·(−1/√2)
        (tensor([[1.0000, 0.5000],
                [1.0000, 1.0000]], dtype=torch.float64), tensor([[ 0.0000, -0.3536],
                [-0.3536,  0.0000]], dtype=torch.float64))
    """
    check_square("gramian", gramian)
    weights, new_targets = _vaccinated(gramian, orders, targets, beta, eps, max_step)
    return coefficients(orders, weights), new_targets


def _vaccinated(gramian: Tensor, orders: Tensor, targets: Tensor, beta: float, eps: float,
                max_step: float) -> tuple[Tensor, Tensor]:
    """``(weights, new_targets)``: the pass of :func:`gradvac_coefficients` as its visits'
    weights ``[steps, K]`` (:func:`~._pairwise.pass_weights`; ``C`` scattered from them,
    ``1ᵀC`` summed by :func:`~._pairwise.column_sums`) and the updated targets."""
    gram = gramian.to(torch.float64)
    orders = orders.to(gram.device)
    old = targets.to(gram.device, torch.float64)
    visits = _Vaccination(gram, orders, old, eps, max_step)
    weights = pass_weights(gram, orders, visits)
    new = torch.add((1 - beta) * visits.hat, visits.phi, alpha=beta)
    return weights, old.scatter(1, orders, new.T.contiguous())


def _update_weights(gramian: Tensor, orders: Tensor, targets: Tensor, beta: float, eps: float,
                    max_step: float) -> tuple[Tensor, Tensor]:
    """``(1ᵀC, new_targets)`` of :func:`gradvac_coefficients` without forming ``C``."""
    weights, new_targets = _vaccinated(gramian, orders, targets, beta, eps, max_step)
    return column_sums(orders, weights), new_targets


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """``num / den``, 0 where ``den`` is 0 (``eps = 0`` with a zero gradient)."""
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


class _Vaccination:
    """The visits of :func:`gradvac_coefficients`: ``w`` at step ``t`` from the dots.

    Everything that depends on the pair only (``‖gⱼ‖``, ``φ̂ᵢⱼ``, ``√(1−φ̂²)``, the paper
    step's denominator ``‖gⱼ‖√(1−φ̂²) + eps``, the cap ``ρ‖gᵢ‖/‖gⱼ‖``) is read once, step
    by task (``[K−1, K]``); a step keeps ``‖g_i^PC‖²`` and records the cosine ``φ``, from
    which the targets move after the pass.
    ``φ ≥ φ̂``, a zero ``gⱼ`` or a zero ``g_i^PC`` give ``w = 0`` (adding ``gⱼ`` could not
    lift the cosine): the lift ``‖g_i^PC‖ sin(θ − θ̂)`` is then 0 or the cap is.
    """

    def __init__(self, gram: Tensor, orders: Tensor, targets: Tensor, eps: float,
                 max_step: float) -> None:
        diag = torch.diagonal(gram)
        norms = diag.clamp_min(0).sqrt()
        by_step = orders.T.contiguous()  # every per-pair tensor [step, task], rows contiguous
        self.hat = targets.gather(1, orders).T.contiguous()
        norm_j, diag_j = (t.index_select(0, by_step.view(-1)).view(by_step.shape)
                          for t in (norms, diag))
        root_hat = (1 - self.hat * self.hat).clamp_min_(0).sqrt_()
        den = torch.addcmul(torch.full_like(norm_j, eps), norm_j, root_hat)
        self.zero_den = not eps > 0 and bool((den == 0).any())  # eps > 0: den ≥ eps
        self.phi = torch.empty_like(self.hat)  # the cosines at the visits
        cap = torch.div(max_step * norms, norm_j).masked_fill_(norm_j == 0, 0.0)
        # Each step's row of every per-pair tensor, as views made once (a visit reads 7).
        self.rows = list(zip(norm_j.unbind(0), diag_j.unbind(0), self.hat.unbind(0),
                             root_hat.unbind(0), den.unbind(0), cap.unbind(0),
                             self.phi.unbind(0), strict=True))
        self.sq = diag.clone()  # ‖g_i^PC‖², kept up to date visit by visit
        self.one, self.eps = torch.ones_like(diag), torch.full_like(diag, eps)
        self.bare = not eps > 0  # the cosine's denominator may be 0: 0 / 0 read as 0

    def __call__(self, t: int, dot: Tensor, out: Tensor) -> Tensor:
        norm_j, diag_j, hat, root_hat, den_j, cap, phi_t = self.rows[t]
        norm_i = self.sq.clamp_min(0).sqrt_()
        den = torch.addcmul(self.eps, norm_i, norm_j)
        if self.bare:
            phi = phi_t.copy_(_ratio(dot, den)).clamp_(-1.0, 1.0)
        else:
            phi = torch.div(dot, den, out=phi_t).clamp_(-1.0, 1.0)
        # The paper's step, clamped to w‖gⱼ‖ ≤ ρ‖gᵢ‖, 0 if φ ≥ φ̂.
        root_phi = torch.addcmul(self.one, phi, phi, value=-1.0).sqrt_()  # |φ| ≤ 1: φ² ≤ 1
        lift = torch.mul(hat, root_phi).addcmul_(phi, root_hat, value=-1.0)
        lift.mul_(norm_i).clamp_min_(0)  # ‖g_i^PC‖ sin(θ − θ̂)
        if self.zero_den:  # 0 / 0: no lift, no step; x / 0 with x > 0: the cap
            paper = torch.where(den_j > 0, lift / den_j, torch.where(lift > 0, torch.inf, 0.0))
        else:
            paper = lift.div_(den_j)
        w = torch.minimum(paper, cap, out=out).masked_fill_(phi >= hat, 0.0)
        self.sq.addcmul_(w, torch.addcmul(dot, w, diag_j, value=0.5), value=2.0)
        return w


def _checked_groups(groups: object) -> list[int]:
    """``groups``: a non-empty sequence of positive ints (parameter counts); ``ValueError``
    naming it otherwise (a float or a bool was truncated to an int, a number or a string gave
    Python's error)."""
    sizes: list[object] = []
    if isinstance(groups, Tensor) and groups.dim() == 1 and not groups.is_floating_point():
        sizes = list(groups.tolist())
    elif isinstance(groups, (list, tuple)):
        sizes = list(groups)
    if not sizes or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                            for n in sizes):
        raise ValueError(
            f"Invalid groups: {groups!r} (expected positive parameter counts, integers, e.g. "
            f"[p.numel() for p in trunk.parameters()])"
        )
    return [int(n) for n in sizes]  # type: ignore[call-overload]


class GradVac(OwnedGeneratorState):
    """GradVac (Wang et al. 2021): ``g = Σᵢ g_i^PC``, cosines lifted to EMA targets.

    Like PCGrad, each task gradient visits the others in a random order, but instead of
    removing conflict it adds just enough of ``gⱼ`` to lift ``cos(g_i^PC, gⱼ)`` to the target
    ``φ̂ᵢⱼ``, an EMA of the observed cosines (initially 0, where GradVac equals PCGrad).
    ``O(K³)`` in K on the Gramian (:func:`gradvac_coefficients`), ``O(K²)`` state.

    Cost in K: ``O(K³)``: PCGrad's blocked pass; state ``O(K²)``.

    Args:
        num_tasks: K (optional; the EMA targets are created on the first call otherwise).
        beta: EMA rate ``β`` in ``φ̂ ← (1−β)φ̂ + βφ``, ``0 <= beta <= 1``. Default ``0.01``
            (``β = 1e-2``, the paper's setting for the EMA targets of Algorithm 1, a slow
            average over about 100 steps); LibMTL and TorchJD default to ``0.5``, which
            follows the last few steps' cosines.
        eps: added to the cosine and weight denominators (on the trace-normalised Gramian).
        max_step: ``ρ > 0``, the most one vaccination step adds, ``w‖gⱼ‖ ≤ ρ‖gᵢ‖``
            (default 1.0). It bounds the update, ``‖g‖ ≤ (1 + ρ(K−1)) Σₖ‖gₖ‖``, where the
            paper's step diverges as a target nears 1 (e.g. after colinear gradients); at
            the default it never binds while every target is ``≤ 0`` (PCGrad's regime), see
            :func:`gradvac_coefficients`.
        groups: None (default): one target per ordered task pair over the whole trunk (the
            paper's ``whole_model``). Or the sizes of contiguous parameter groups (summing to
            ``P``, e.g. ``[p.numel() for p in trunk.parameters()]``): one target per pair per
            group, each group vaccinated apart (LibMTL's ``all_layer`` / ``all_matrix``). With
            groups the balancer needs the ``[K, P]`` rows (``from_gramian`` is False).
        generator: source of the visiting orders (see :class:`PCGrad`).

    State: ``targets`` ``[K, K]`` (or ``[n_groups, K, K]``) and the generator state.

    Example:
        >>> import torch
        >>> from gradbalance.balancers import GradVac
        >>> g = torch.tensor([[1.0, 0.0], [-1.0, 1.0]], dtype=torch.float64)
        >>> GradVac()(g)  # the targets start at 0: PCGrad's update (see PCGrad)
        tensor([0.5000, 1.5000], dtype=torch.float64)
    """

    targets: Tensor | None

    name = "gradvac"
    from_gramian = True
    homogeneous = True

    def __init__(
        self,
        num_tasks: int | None = None,
        *,
        beta: float = 0.01,
        eps: float = 1e-8,
        max_step: float = 1.0,
        groups: Sequence[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__(num_tasks)
        beta = check_range("beta", beta, 0.0, 1.0)
        eps = check_range("eps", eps, 0.0, None)
        max_step = check_range("max_step", max_step, 0.0, None, low_open=True)
        if groups is not None:
            groups = _checked_groups(groups)
        self.beta = float(beta)
        self.eps = float(eps)
        self.max_step = float(max_step)
        self.groups = groups
        self.from_gramian = groups is None
        self.generator = check_generator("generator", generator) or private_generator()
        self.register_state("targets", None if num_tasks is None else self._zeros(num_tasks),
                            optional=True, pairwise=True)

    def _zeros(self, k: int) -> Tensor:
        shape = (k, k) if self.groups is None else (len(self.groups), k, k)
        return torch.zeros(shape, dtype=torch.float64)

    def _current_targets(self, k: int) -> Tensor:
        if self.num_tasks is None:
            self.num_tasks = k  # the targets are per task pair: K is fixed from now on
        if self.targets is None or self.targets.shape[-1] != k:
            return self._zeros(k)
        return self.targets

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        if self.groups is not None:
            raise TypeError(
                "GradVac with groups needs the task-gradient rows, not one Gramian; call "
                "combine(matrix) (mode='matrix')"
            )
        k = gramian.shape[0]
        gram, _ = trace_normalized(gramian)
        targets = self._current_targets(k)
        weights, new_targets = _update_weights(
            gram, gradvac_orders(k, self.generator), targets, self.beta, self.eps, self.max_step
        )
        self.targets = new_targets
        return weights.to(gramian.device)

    def _combine_matrix(self, matrix: Tensor, losses: Tensor | None) -> Combination:
        return self._combine_groups(matrix, Shard.whole(matrix.shape[1]), local=True)

    def _combine_matrix_sharded(self, matrix: Tensor, losses: Tensor | None, gramian: Tensor,
                                shard: Shard) -> Combination:
        """Each group is a column range of the full matrix: its Gramian is summed over ranks
        from the local columns in that range (one ``[n_groups, K, K]`` reduce); each local
        column then takes its group's weights."""
        return self._combine_groups(matrix, shard, local=False)

    def _combine_groups(self, matrix: Tensor, shard: Shard, local: bool) -> Combination:
        """With ``local`` (one process) no reduce is called."""
        assert self.groups is not None
        k = matrix.shape[0]
        if sum(self.groups) != shard.total:
            raise ValueError(
                f"groups sum to {sum(self.groups)} parameters but the matrix has {shard.total} "
                f"columns; pass the sizes of the shared parameters, in order"
            )
        bounds = torch.tensor([0, *self.groups]).cumsum(0).tolist()
        pieces = [list(shard.pieces(bounds[g], bounds[g + 1])) for g in range(len(self.groups))]
        grams = torch.zeros(len(self.groups), k, k, dtype=torch.float64, device=matrix.device)
        for g, group in enumerate(pieces):
            for start, length in group:
                grams[g] += compute_gramian(matrix[:, start : start + length])
        if not local:
            grams = shard.sum(grams)
        targets = self._current_targets(k)
        orders = gradvac_orders(k, self.generator)
        out = torch.empty(matrix.shape[1], dtype=matrix.dtype, device=matrix.device)
        new_targets = []
        for g, group in enumerate(pieces):
            gram, _ = trace_normalized(grams[g])
            sums, new = _update_weights(gram, orders, targets[g], self.beta, self.eps,
                                        self.max_step)
            weights = sums.to(matrix.device, matrix.dtype)
            for start, length in group:
                out[start : start + length] = weights @ matrix[:, start : start + length]
            new_targets.append(new)
        self.targets = torch.stack(new_targets)
        return Combination(out)

    def _check_state(self, tensors: dict[str, Tensor | None], extra: dict[str, Any]) -> None:
        super()._check_state(tensors, extra)
        self._check_targets(tensors["targets"])

    def _load_extra(self, extra: dict[str, Any]) -> None:
        super()._load_extra(extra)
        self.learned_num_tasks(self.targets, -1)

    def _check_targets(self, targets: Tensor | None) -> None:
        """Saved targets checked against ``groups`` (their tasks: the declaration)."""
        if targets is not None:
            expected = 2 if self.groups is None else 3
            if targets.dim() != expected or (
                self.groups is not None and targets.shape[0] != len(self.groups)
            ):
                want = "[K, K]" if self.groups is None else f"[{len(self.groups)}, K, K]"
                raise ValueError(
                    f"GradVac state_dict['targets'] has shape {tuple(targets.shape)}, expected "
                    f"{want} (one target per task pair{'' if self.groups is None else ' and group'}"
                    f" with groups={self.groups}); load a state saved by a GradVac with the "
                    f"same groups"
                )

    def __repr__(self) -> str:
        return (
            f"GradVac(num_tasks={self.num_tasks}, beta={self.beta}, eps={self.eps}, "
            f"max_step={self.max_step}, groups={self.groups})"
        )
