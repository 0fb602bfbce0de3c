"""Kinds of task-gradient rows for the many-task checks, and the pairwise balancers' loops.

The kinds follow ``benchmarks/many_tasks.py``'s (float64 here): conflicting rows, near
duplicates of a few directions, norms spanning 1e-6 … 1e6, rank 1 and rank 8, all aligned
(a positive Gramian), half zero, a mix of them, and rows of rank ``K/2`` plus noise 1e-2 of
their size (full rank, badly conditioned). The loops are the papers' algorithms one
pair at a time, the slow references of PCGrad's and GradVac's blocked passes.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from gradbalance.balancers import _pairwise

F64 = torch.float64
KIND_NAMES = ["conflicting", "near_duplicates", "wide_norms", "rank1", "rank8", "aligned",
              "half_zero", "mixed", "noisy_span"]


def _conflicting(k: int, p: int, gen: torch.Generator) -> Tensor:
    shared = torch.randn(p, generator=gen, dtype=F64)
    return (torch.randn(k, 1, generator=gen, dtype=F64) * shared
            + 0.5 * torch.randn(k, p, generator=gen, dtype=F64))


def _one_kind(kind: str, k: int, p: int, gen: torch.Generator) -> Tensor:
    if kind == "near_duplicates":  # K/4 near copies of 4 directions, 1e-6 apart (relative)
        dirs = torch.randn(4, p, generator=gen, dtype=F64)
        pick = torch.randint(0, 4, (k,), generator=gen)
        return dirs[pick] + 1e-6 * torch.randn(k, p, generator=gen, dtype=F64)
    if kind == "wide_norms":
        scales = torch.logspace(-6, 6, k, dtype=F64)[torch.randperm(k, generator=gen)]
        return _conflicting(k, p, gen) * scales[:, None]
    if kind in ("rank1", "rank8"):
        r = 1 if kind == "rank1" else 8
        return (torch.randn(k, r, generator=gen, dtype=F64)
                @ torch.randn(r, p, generator=gen, dtype=F64))
    if kind == "noisy_span":  # rank K/2 plus noise 1e-2: full rank, condition number ~1e5
        r = max(k // 2, 1)
        return (torch.randn(k, r, generator=gen, dtype=F64)
                @ torch.randn(r, p, generator=gen, dtype=F64) / r**0.5
                + 1e-2 * torch.randn(k, p, generator=gen, dtype=F64))
    if kind == "aligned":  # aᵢ s + nᵢ/2 with aᵢ ≥ 1: no conflict
        shared = torch.randn(p, generator=gen, dtype=F64)
        scale = 1 + torch.randn(k, 1, generator=gen, dtype=F64).abs()
        return scale * shared + 0.5 * torch.randn(k, p, generator=gen, dtype=F64)
    g = _conflicting(k, p, gen)
    if kind == "half_zero":
        g[torch.randperm(k, generator=gen)[: k // 2]] = 0.0
    return g


def kind_rows(kind: str, k: int, p: int, seed: int) -> Tensor:
    """``[K, P]`` float64 task gradients of one kind (``mixed``: the other kinds in turn, a
    sixth of the rows zero, shuffled)."""
    gen = torch.Generator().manual_seed(seed)
    if kind != "mixed":
        return _one_kind(kind, k, p, gen)
    parts = [_one_kind(KIND_NAMES[i % 6], 1, p, gen) for i in range(k - k // 6)]
    parts.append(torch.zeros(k // 6, p, dtype=F64))
    return torch.cat(parts)[torch.randperm(k, generator=gen)]


def pcgrad_loop(g: Tensor, orders: Tensor) -> Tensor:
    """Yu et al. (2020), Algorithm 1, on the rows themselves: the sum of the ``g_i^PC``."""
    out = torch.zeros_like(g[0])
    for i in range(g.shape[0]):
        gi = g[i].clone()
        for j in orders[i].tolist():
            dot = float(gi @ g[j])
            if j != i and dot < 0 and float(g[j] @ g[j]) > 0:
                gi = gi - dot / float(g[j] @ g[j]) * g[j]
        out += gi
    return out


def gradvac_loop(gram: Tensor, orders: Tensor, targets: Tensor, beta: float, eps: float,
                 max_step: float, conditioned: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Wang et al. (2021), Algorithm 1 with the step cap, one pair at a time on the Gramian
    (every dot and norm read afresh from ``C``; ``(C, new targets)``). ``conditioned``
    ``[K, K]`` (bool), where given, is set False at the visits ``(i, j)`` where ``g_i^PC`` has
    cancelled below ``1e-4 ‖gᵢ‖``: its norm, read from ``cᵀGc``, then carries a rounding
    above 1e-8 of itself, and its cosine more than the tests' 1e-6."""
    k = gram.shape[0]
    coef, hat = torch.eye(k, dtype=F64), targets.clone()
    norms = torch.diagonal(gram).clamp_min(0).sqrt().tolist()
    for i in range(k):
        for j in orders[i].tolist():
            dot = float(coef[i] @ gram[:, j])
            norm_i = max(float(coef[i] @ gram @ coef[i]), 0.0) ** 0.5
            if conditioned is not None:
                conditioned[i, j] = norm_i >= 1e-4 * norms[i]
            den = norm_i * norms[j] + eps
            phi = min(max(dot / den, -1.0), 1.0) if den > 0 else 0.0
            h = float(hat[i, j])
            if phi < h and norms[j] > 0 and norm_i > 0:
                lift = max(norm_i * (h * (1 - phi**2) ** 0.5 - phi * (1 - h**2) ** 0.5), 0.0)
                den2 = norms[j] * (1 - h**2) ** 0.5 + eps
                paper = lift / den2 if den2 > 0 else (math.inf if lift > 0 else 0.0)
                coef[i, j] += min(paper, max_step * norms[i] / norms[j])
            hat[i, j] = (1 - beta) * h + beta * phi
    return coef, hat


def assert_same_update(a: Tensor, b: Tensor, g: Tensor, cancelled: bool = False) -> None:
    """cos ≥ 0.999999 and norms within 1e-6 (or both below ``1e-9 Σ‖gₖ‖`` and close);
    ``cancelled`` (a pass that visited a row cancelled to rounding, whose cosines are
    rounding): within ``1e-8 Σ‖gₖ‖``, the scale the rounding has."""
    assert bool(torch.isfinite(a).all())
    floor = float(g.norm(dim=1).sum())
    na, nb = float(a.norm()), float(b.norm())
    if cancelled or nb <= 1e-9 * floor:
        assert float((a - b).norm()) <= 1e-8 * floor
        return
    assert float(a @ b) / (na * nb) >= 0.999999
    assert abs(na - nb) <= 1e-6 * nb


def pass_settings(mp: pytest.MonkeyPatch, how: tuple[int, ...]) -> None:
    """The pass's block size and sparse cost, and (a third entry) its column tiles' width."""
    block, cost = how[:2]
    mp.setattr(_pairwise, "pass_block", lambda k: block)
    mp.setattr(_pairwise, "SPARSE_COST", cost)
    if len(how) > 2:
        mp.setattr(_pairwise, "tile_width", lambda k, device: how[2])


def check_pcgrad_pass(g: Tensor, seed: int, how: tuple[int, ...]) -> None:
    """PCGrad's blocked pass run as ``how`` says (:func:`pass_settings`) against the loop."""
    from gradbalance.balancers._pcgrad import pcgrad_coefficients, pcgrad_orders

    orders = pcgrad_orders(g.shape[0], torch.Generator().manual_seed(seed))
    with pytest.MonkeyPatch.context() as mp:
        pass_settings(mp, how)
        fast = pcgrad_coefficients(g @ g.T, orders).sum(dim=0) @ g
    assert_same_update(fast, pcgrad_loop(g, orders), g)


def check_gradvac_pass(g: Tensor, seed: int, beta: float, how: tuple[int, ...]) -> None:
    """GradVac's blocked pass (random targets in ``[−0.8, 0.8]``) against the pair loop: the
    same update and the same new targets."""
    from gradbalance.balancers._gradvac import gradvac_coefficients, gradvac_orders
    from gradbalance.balancers._solvers import trace_normalized

    k = g.shape[0]
    gram, _ = trace_normalized(g @ g.T)
    gen = torch.Generator().manual_seed(seed)
    orders = gradvac_orders(k, gen)
    targets = torch.rand(k, k, generator=gen, dtype=F64) * 1.6 - 0.8
    with pytest.MonkeyPatch.context() as mp:
        pass_settings(mp, how)
        coef, hat = gradvac_coefficients(gram, orders, targets, beta, 1e-8, 1.0)
    conditioned = torch.ones(k, k, dtype=torch.bool)
    ref_coef, ref_hat = gradvac_loop(gram, orders, targets, beta, 1e-8, 1.0, conditioned)
    assert_same_update(coef.sum(dim=0) @ g, ref_coef.sum(dim=0) @ g, g,
                       cancelled=not bool(conditioned.all()))
    torch.testing.assert_close(hat[conditioned], ref_hat[conditioned], rtol=1e-6, atol=1e-6)
