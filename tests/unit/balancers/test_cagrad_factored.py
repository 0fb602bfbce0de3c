"""CAGrad's root search on a singular or badly conditioned Gramian (one factor per search).

Rows of the kinds of ``benchmarks/many_tasks.py`` (rank 1, a low-rank span, near
duplicates, exact and near copies of 4 directions with norms over 6 decades, norms over 12
decades), rounded to float32 as a model's gradients are. The dual weights against their own
KKT conditions (a closed form of the gradient of ``wᵀlin + r‖g_w‖``) and against scipy's
SLSQP on the same objective.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers._boxqp import is_well_conditioned
from gradbalance.balancers._solvers import cagrad_dual, trace_normalized

F64 = torch.float64
KINDS = ("rank1", "span3", "near_duplicates", "duplicate_blocks", "wide_norms")


def rows(kind: str, k: int, seed: int) -> Tensor:
    """``[K, 40]`` float32 rows of one kind, as float64."""
    gen = torch.Generator().manual_seed(seed)
    p = 40
    if kind == "rank1":
        g = torch.randn(k, 1, generator=gen) * torch.randn(1, p, generator=gen)
    elif kind == "span3":
        g = torch.randn(k, 3, generator=gen) @ torch.randn(3, p, generator=gen)
    elif kind == "near_duplicates":
        dirs = torch.randn(3, p, generator=gen)
        g = dirs[torch.randint(0, 3, (k,), generator=gen)] + 1e-6 * torch.randn(
            k, p, generator=gen)
    elif kind == "duplicate_blocks":  # 4 directions, exact and 1e-6 copies, norms 1e±3
        dirs = torch.randn(4, p, generator=gen)
        g = dirs[torch.randint(0, 4, (k,), generator=gen)]
        g = g * torch.logspace(-3, 3, k)[torch.randperm(k, generator=gen), None]
        g[::2] += 1e-6 * g[::2].norm(dim=1, keepdim=True) * torch.randn(g[::2].shape,
                                                                         generator=gen)
    else:  # wide norms, k > p: singular too
        g = torch.randn(k, p, generator=gen) * torch.logspace(-6, 6, k)[:, None]
    return g.float().double()


def objective(gram: Tensor, lin: Tensor, r: float, w: np.ndarray) -> float:
    """``wᵀlin + r √(wᵀGw)``."""
    wt = torch.from_numpy(w)
    return float(wt @ lin) + r * max(float(wt @ gram @ wt), 0.0) ** 0.5


def gradient(gram: np.ndarray, lin: np.ndarray, r: float, w: np.ndarray) -> np.ndarray:
    """``lin + r Gw/‖g_w‖`` (``lin`` where ``g_w = 0``)."""
    gw = gram @ w
    norm = max(float(w @ gw), 0.0) ** 0.5
    return lin + (r / norm) * gw if norm > 0.0 else lin


def slsqp(gram: Tensor, lin: Tensor, r: float) -> float:
    """The dual's optimal value by scipy's SLSQP from the mean (best of it and the vertices)."""
    from scipy.optimize import minimize

    k = gram.shape[0]
    g_np, lin_np = gram.numpy(), lin.numpy()
    res = minimize(lambda w: objective(gram, lin, r, w), np.full(k, 1.0 / k),
                   jac=lambda w: gradient(g_np, lin_np, r, w),
                   bounds=[(0.0, 1.0)] * k, method="SLSQP",
                   constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1.0}],
                   options={"ftol": 1e-15, "maxiter": 500})
    vertices = min(objective(gram, lin, r, np.eye(k)[i]) for i in range(k))
    return min(objective(gram, lin, r, np.clip(res.x, 0, None) / np.clip(res.x, 0, None).sum()),
               vertices)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=4, deadline=None)
@given(st.integers(17, 24), st.integers(0, 2**16),
       st.sampled_from([0.2, 0.5, 0.8]))
def test_cagrad_on_a_factor_meets_kkt_and_slsqp(kind: str, k: int, seed: int, c: float) -> None:
    g = rows(kind, k, seed)
    gram, _ = trace_normalized(g @ g.T)
    assert not is_well_conditioned(gram)  # the factored path
    mean = torch.full((k,), 1.0 / k, dtype=F64)
    lin = gram @ mean
    r = c * float(mean @ lin) ** 0.5
    w = cagrad_dual(gram, c)
    assert float(w.min()) >= 0.0 and abs(float(w.sum()) - 1.0) < 1e-12
    value = objective(gram, lin, r, w.numpy())
    # A Gramian fixes ‖g_w‖ only to about √(K eps) of its scale (``_solvers``, "Accuracy").
    assert value <= slsqp(gram, lin, r) + 1e-7 * r + 1e-9 * abs(value)
    norm = float(w @ gram @ w) ** 0.5
    if norm < 1e-6 * r:
        return  # a (nearly) zero-norm combination: the gradient below is undefined
    grad = lin + r * (gram @ w) / norm
    scale = 1.0 + float(grad.abs().max())
    support = w > 1e-9
    nu = float(grad[support].mean())
    assert float((grad[support] - nu).abs().max()) <= 1e-7 * scale
    assert float((grad - nu).min()) >= -1e-7 * scale
