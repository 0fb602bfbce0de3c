"""Independent references for the Gramian balancers: textbook [K, P] code and scipy solvers."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import strategies as st
from torch import Tensor

from gradbalance import BALANCERS, Balancer
from gradbalance.balancers import Constant

#: Balancers whose constructor needs arguments besides ``num_tasks`` / ``generator``.
FACTORY: dict[str, Callable[[int, int], Balancer]] = {
    "constant": lambda k, seed: Constant([1.0 + 0.5 * i for i in range(k)]),
}


def build_balancer(name: str, num_tasks: int | None, seed: int = 0) -> Balancer:
    """``BALANCERS[name]`` with its defaults, ``num_tasks`` and a seeded generator where its
    constructor takes them, or the ``FACTORY`` entry; fails the test if an argument is missing.
    """
    if name in FACTORY:
        assert num_tasks is not None
        return FACTORY[name](num_tasks, seed)
    cls = BALANCERS[name]
    params = inspect.signature(cls).parameters
    kwargs: dict[str, object] = {}
    if "num_tasks" in params:
        kwargs["num_tasks"] = num_tasks
    if "generator" in params:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in kwargs]
    if missing:
        pytest.fail(f"{name} needs {missing}: add it to support.balancers.FACTORY "
                    f"(docs/ARCHITECTURE.md, \"Extension contract\", \"Registered by name\")")
    return cls(**kwargs)


def random_matrix(seed: int, k: int, p: int, conflict: bool = True) -> Tensor:
    """A float64 [K, P] matrix; with ``conflict`` the last row leans against the first."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, p, generator=gen, dtype=torch.float64)
    if conflict and k > 1:
        g[-1] = g[-1] - 1.5 * g[0]
    return g


@st.composite
def matrices(draw: st.DrawFn, min_k: int = 2, max_k: int = 6, min_p: int = 1,
             max_p: int = 8) -> Tensor:
    k = draw(st.integers(min_k, max_k))
    p = draw(st.integers(min_p, max_p))
    seed = draw(st.integers(0, 2**31 - 1))
    return random_matrix(seed, k, p, conflict=draw(st.booleans()))


def textbook_pcgrad(g: Tensor, orders: Tensor) -> Tensor:
    """PCGrad on the rows, as written in the paper's Algorithm 1 (same visiting orders)."""
    k = g.shape[0]
    out = []
    for i in range(k):
        gi = g[i].clone()
        for j in orders[i].tolist():
            if j == i:
                continue
            dot = gi @ g[j]
            if dot < 0:
                gi = gi - dot / (g[j] @ g[j]) * g[j]
        out.append(gi)
    return torch.stack(out)


def nnls_dual_cone(g: Tensor, u: Tensor) -> Tensor:
    """Projection of ``gᵀu`` onto ``{x : g x ≥ 0}`` via scipy's NNLS (v = u + x, x ≥ 0)."""
    from scipy.optimize import nnls

    x, _ = nnls(g.T.numpy(), -(g.T @ u).numpy(), maxiter=10_000)
    return g.T @ (u + torch.from_numpy(x))


def scipy_min_norm(g: Tensor) -> float:
    """‖min-norm point of the convex hull of the rows‖² by SLSQP (a second solver)."""
    from scipy.optimize import minimize

    gram = (g @ g.T).numpy()
    k = gram.shape[0]
    res = minimize(lambda w: w @ gram @ w, np.full(k, 1 / k), jac=lambda w: 2 * gram @ w,
                   bounds=[(0, 1)] * k, constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1}],
                   method="SLSQP", options={"ftol": 1e-15, "maxiter": 1000})
    return float(res.fun)


def scipy_min_norm_value(points: np.ndarray) -> float:
    """``min_{w ∈ Δ} ‖Pw‖²`` (the columns of ``P`` the points) by scipy's NNLS of the
    least-distance program (Lawson & Hanson 1974, Ch. 23: ``u = argmin_{u ≥ 0} ‖[P; 1ᵀ]u −
    e‖``, ``w = u/Σu``)."""
    from scipy.optimize import nnls

    e = np.vstack([points, np.ones(points.shape[1])])
    f = np.zeros(e.shape[0])
    f[-1] = 1.0
    u, _ = nnls(e, f, maxiter=100 * points.shape[1])
    w = u / u.sum()
    return float(np.sum((points @ w) ** 2))


def scipy_cagrad_value(g: Tensor, c: float) -> float:
    """``max_d min_k gₖ·d`` s.t. ``‖d − g₀‖ ≤ c‖g₀‖`` (CAGrad's primal) by SLSQP."""
    from scipy.optimize import minimize

    a = g.numpy()
    g0 = a.mean(axis=0)
    r = c * np.linalg.norm(g0)
    # variables (d, t): maximise t s.t. a d >= t, ||d - g0||^2 <= r^2
    x0 = np.concatenate([g0, [float((a @ g0).min())]])
    cons = [
        {"type": "ineq", "fun": lambda x: a @ x[:-1] - x[-1], "jac": lambda x: np.hstack(
            [a, -np.ones((a.shape[0], 1))])},
        {"type": "ineq", "fun": lambda x: r * r - np.sum((x[:-1] - g0) ** 2),
         "jac": lambda x: np.concatenate([-2 * (x[:-1] - g0), [0.0]])},
    ]
    res = minimize(lambda x: -x[-1], x0, jac=lambda x: np.concatenate([np.zeros(len(g0)), [-1]]),
                   constraints=cons, method="SLSQP", options={"ftol": 1e-14, "maxiter": 2000})
    return -float(res.fun)


def unit_dual_cone_projection(g: Tensor, point: Tensor) -> Tensor:
    """Projection of ``point`` ``[P]`` onto ``{d : gₖ·d ≥ 0}`` (float64) by scipy's NNLS on
    the unit rows (the same cone at any norms; a zero row constrains nothing):
    ``d = point + Uᵀμ``, ``μ = argmin_{μ ≥ 0} ‖point + Uᵀμ‖``."""
    from scipy.optimize import nnls

    rows = g.double()
    norms = rows.norm(dim=1)
    unit = rows[norms > 0] / norms[norms > 0, None]
    if unit.shape[0] == 0:
        return point.double().clone()
    mu, _ = nnls(unit.T.numpy(), -point.double().numpy(), maxiter=100 * unit.shape[0] + 100)
    return point.double() + unit.T @ torch.from_numpy(mu)


def check_cagrad_zero_optimum(g: Tensor, update: Tensor, tol: float, c: float = 0.4) -> bool:
    """Whether CAGrad's optimum on the float64 rows ``g`` is 0 (``0`` in their convex hull and
    ``g₀``'s projection onto ``{d : gₖ·d ≥ 0}`` within ``c‖g₀‖``: every conflict-free update
    of the ball is optimal, none better); if so, asserts that ``update`` is the one closest
    to ``g₀`` (:func:`unit_dual_cone_projection`): within ``tol·‖g₀‖`` of it, no task's
    cosine with it below ``−tol``, inside the ball."""
    rows = g.double()
    g0 = rows.mean(dim=0)
    radius = c * float(g0.norm())
    expected = unit_dual_cone_projection(rows, g0)
    if float((expected - g0).norm()) > radius * (1 - 1e-9):
        return False  # the ball does not reach a conflict-free update inside it
    norms = rows.norm(dim=1)
    live = norms > 0
    scale = float(norms.max() * g0.norm())
    if bool(live.all()) and abs(scipy_cagrad_value(rows, c)) > 1e-9 * scale:
        return False  # 0 is not in the convex hull (no zero row; SLSQP): a positive optimum
    d = update.double()
    assert float((d - expected).norm()) <= tol * float(g0.norm())
    cosines = (rows[live] @ d) / (norms[live] * d.norm()).clamp_min(1e-300)
    assert float(cosines.min()) >= -tol
    assert float((d - g0).norm()) <= radius * (1 + tol)
    return True


def scipy_pcd(g: Tensor, tau: float | Tensor) -> Tensor:
    """PCD's ``d = argmin ½‖d − g₁‖²`` s.t. ``gⱼᵀd ≥ τ‖gⱼ‖²`` on the rows (``tau`` one number
    or one per secondary row), by scipy's NNLS
    of the least-distance program in ``x = d − g₁`` (Lawson & Hanson 1974, Ch. 23); ``g₁``
    where it is infeasible (the residual vanishes, as :func:`~gradbalance.balancers._boxqp.ldp`
    decides: below ``√eps``)."""
    from scipy.optimize import nnls

    rest = g[1:]
    h = tau * (rest * rest).sum(dim=1) - rest @ g[0]
    e = torch.cat([rest.T, h[None]]).numpy()
    f = np.zeros(e.shape[0])
    f[-1] = 1.0
    u, _ = nnls(e, f, maxiter=100 * e.shape[1])
    rho = e @ u - f
    if float(np.linalg.norm(rho)) < torch.finfo(torch.float64).eps ** 0.5:
        return g[0]
    return g[0] + torch.from_numpy(-rho[:-1] / rho[-1])


def outlying(q: Tensor) -> int:
    """How many leading eigenvalues of ``q`` (``torch.linalg.eigvalsh``) the preconditioner
    deflates by its definition (:func:`~._precond.deflated` estimates them by subspace
    iteration): the ``m ≤ MAX_DEFLATED`` before the largest gap ``λ_m ≥ GAP_RATIO λ_{m+1}``
    with ``λ_m ≥ LOOSE_RATIO`` times the mean of those below it, else the largest ``m ≤
    FIRST_WIDTH`` with ``λ_m ≥ OUTLIER_RATIO`` times that mean."""
    from gradbalance.balancers import _precond as pc

    lam = torch.linalg.eigvalsh(q).flip(0).tolist()
    k = len(lam)
    mean = [sum(lam[j + 1:]) / (k - j - 1) for j in range(min(k - 1, pc.MAX_DEFLATED))]
    gaps = [(lam[j] / lam[j + 1], j + 1) for j in range(len(mean))
            if lam[j + 1] > 0 and lam[j] >= pc.LOOSE_RATIO * mean[j]
            and lam[j] >= pc.GAP_RATIO * lam[j + 1]]
    if gaps:
        return max(gaps)[1]
    return max((j + 1 for j in range(min(len(mean), pc.FIRST_WIDTH))
                if lam[j] >= pc.OUTLIER_RATIO * mean[j]), default=0)


def classifier_rows(k: int, classes: int, width: int, seed: int) -> Tensor:
    """``[K, C (width + 1)]`` float64: each sample's gradient of the cross-entropy at a
    linear head ``W h + b`` on ReLU features ``h`` (Gaussian inputs, random labels, ``W``
    small): ``[vec(b ⊗ h), b]`` with ``b = softmax(Wh) − e_y``."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.relu(torch.randn(k, width, generator=gen, dtype=torch.float64))
    w = 0.1 * torch.randn(classes, width, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, classes, (k,), generator=gen)
    back = torch.softmax(h @ w.T, dim=1) - torch.nn.functional.one_hot(labels, classes)
    return torch.cat([(back[:, :, None] * h[:, None, :]).reshape(k, -1), back], dim=1)
