"""The K-dimensional solvers on rank-deficient Gramians: every input gets the method's answer.

Colinear rows, ``K > P``, rows in a low-dimensional subspace, zero rows, float32 rank-1 rows
and near-singular Gramians are ordinary in training. Each method is checked against its own
optimality conditions, computed here from the float64 Gramian (never from the solver), or
against an independent solver: scipy's NNLS on the rows for the dual-cone projections, SLSQP
on CAGrad's primal, and an enumeration of active faces in numpy for PCD.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

from gradbalance.balancers import CRMOGM, MGDA, PCD, CAGrad, DualProj, UPGrad, _boxqp
from gradbalance.balancers._boxqp import FALLBACK_ITERATIONS, nnls
from gradbalance.balancers._solvers import cagrad_dual, min_norm_simplex, project_dual_cone
from gradbalance.functional import pcd_weights
from gradbalance.gramian import compute_gramian
from support.balancers import nnls_dual_cone, scipy_cagrad_value

F64 = torch.float64
KINDS = ("low_rank", "k_above_p", "rank_one", "duplicates", "zero_rows", "near_singular")


def degenerate_rows(kind: str, k: int, p: int, seed: int, dtype: torch.dtype) -> Tensor:
    """A ``[K, P]`` matrix of one degenerate kind (float64 draws, then cast to ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    if kind == "low_rank":
        r = 1 + seed % 3
        g = randn(k, r) @ randn(r, p + 3)
    elif kind == "k_above_p":
        g = randn(k, max(1, min(p, k - 1)))
    elif kind == "rank_one":
        g = randn(k)[:, None] * randn(p)[None]
    elif kind == "duplicates":
        g = randn(k, p)
        half = k // 2
        g[half:] = g[: k - half] * (3 * torch.rand(k - half, 1, generator=gen, dtype=F64))
    elif kind == "zero_rows":
        g = randn(k, p)
        g[torch.rand(k, generator=gen) < 0.4] = 0.0
        g[0] = randn(p)  # at least one non-zero row
    else:  # near_singular: rank one plus 1e-6 of noise
        g = randn(k)[:, None] * randn(p)[None] + 1e-6 * randn(k, p)
    return g.to(dtype)


@st.composite
def degenerate(draw: st.DrawFn, min_k: int = 2, max_k: int = 16,
               dtypes: tuple[torch.dtype, ...] = (F64, torch.float32)) -> Tensor:
    kind = draw(st.sampled_from(KINDS))
    k = draw(st.integers(min_k, max_k))
    p = draw(st.integers(1, k + 3))
    return degenerate_rows(kind, k, p, draw(st.integers(0, 2**31 - 1)),
                           draw(st.sampled_from(dtypes)))


def _gram64(g: Tensor) -> Tensor:
    """The exact float64 Gramian of the rows (float32 rows are exact in float64)."""
    rows = g.to(F64)
    return rows @ rows.T


def _rel(g: Tensor) -> float:
    """Tolerance relative to ``tr G``: the balancer's Gramian of float32 rows is float32
    products (relative rounding 6e-8 per product), of float64 rows float64 ones."""
    return 1e-9 if g.dtype == F64 else 1e-5


def assert_min_norm_kkt(gram: Tensor, w: Tensor, rel: float) -> None:
    """MGDA's optimality on the simplex: ``(Gw)ₖ ≥ wᵀGw`` for every k, with equality where
    ``wₖ > 0`` (complementarity ``wₖ((Gw)ₖ − wᵀGw) = 0``)."""
    tol = rel * float(gram.trace())
    assert float(w.min()) >= -1e-12 and abs(float(w.sum()) - 1.0) <= 1e-9
    gw = gram @ w
    gap = gw - w @ gw
    assert float(gap.min()) >= -tol
    assert float((w.clamp_min(0) * gap.abs()).max()) <= tol


def assert_dual_cone_kkt(gram: Tensor, v: Tensor, u: Tensor, rel: float) -> None:
    """The projection QP ``min vᵀGv`` s.t. ``v ≥ u``: ``v ≥ u``, ``Gv ≥ 0`` (its multiplier)
    and ``(vᵢ − uᵢ)(Gv)ᵢ = 0``."""
    scale = rel * float(gram.trace()) * max(1.0, float(v.abs().max()))
    assert float((v - u).min()) >= -1e-12 * max(1.0, float(v.abs().max()))
    gv = gram @ v
    assert float(gv.min()) >= -scale
    assert float(((v - u) * gv).abs().max()) <= scale * max(1.0, float(v.abs().max()))


# -- the reproductions of the issue ----------------------------------------------------------
@pytest.mark.parametrize("seed", range(30))
def test_mgda_three_scalar_tasks(seed: int) -> None:
    # MGDA().combine(torch.randn(3, 1)) raised SolverError for 7 of these 30 seeds.
    torch.manual_seed(seed)
    g = torch.randn(3, 1)
    result = MGDA().combine(g)
    assert result.weights is not None
    assert_min_norm_kkt(_gram64(g), result.weights, 1e-6)
    # By hand: opposite signs put 0 in the hull; one sign gives the smallest |gₖ|.
    values = g.flatten().tolist()
    expected = 0.0 if min(values) < 0 < max(values) else min(abs(v) for v in values)
    assert abs(float(result.vector)) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("seed", range(20))
def test_mgda_sixteen_tasks_in_seven_dimensions(seed: int) -> None:
    # K = 16 > P = 7 raised for most seeds.
    g = torch.randn(16, 7, generator=torch.Generator().manual_seed(seed), dtype=F64)
    w = MGDA().combine(g).weights
    assert w is not None
    assert_min_norm_kkt(_gram64(g), w, 1e-10)


@pytest.mark.parametrize("seed", range(30))
def test_upgrad_rank_one_float32_rows(seed: int) -> None:
    # c·base rows in float32 (UPGrad raised for 18 of 30 seeds): every row is ±base, so the
    # projections of the positive rows cancel with nothing and the update is a multiple of
    # base on which no task loses: gₖ·d ≥ 0 to float32 rounding; NNLS on the rows agrees.
    gen = torch.Generator().manual_seed(seed)
    base, c = torch.randn(8, generator=gen), torch.randn(6, generator=gen)
    g = c[:, None] * base[None]
    scale = float((g.double() ** 2).sum())
    for balancer, pref in ((UPGrad(), None), (DualProj(), torch.full((6,), 1 / 6, dtype=F64))):
        out = balancer(g).double()
        assert float((g.double() @ out).min()) >= -1e-6 * scale
        if pref is not None:
            expected = nnls_dual_cone(g.double(), pref)
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-6 * scale**0.5)


def test_dualproj_rank_deficient_near_miss() -> None:
    # K = 6 > P = 4 in float64: DualProj was off scipy's NNLS by 1.9e-9 here. The rows'
    # conic hull is all of R⁴ (a positive combination vanishes), so the dual cone is {0} and
    # both projections are exactly 0; the weights reach ~900, so wᵀG cancels to rounding,
    # about K·max w·eps·max|g| ≈ 3e-12.
    g = torch.tensor([[-2.0564, 2.0420, -1.1041, 1.5082], [-0.0278, 1.7488, 0.1298, 1.2543],
                      [-0.8452, -0.1289, -0.7942, -0.9937], [0.8614, -0.9427, -0.8667, -2.2287],
                      [0.1926, -0.0802, 0.0499, -0.8412], [-0.3428, -0.8369, 0.2245, 0.1448]],
                     dtype=F64)
    u = torch.full((6,), 1 / 6, dtype=F64)
    zero = torch.zeros(4, dtype=F64)
    torch.testing.assert_close(nnls_dual_cone(g, u), zero, rtol=0, atol=1e-11)
    torch.testing.assert_close(DualProj()(g), zero, rtol=0, atol=1e-11)
    torch.testing.assert_close(UPGrad()(g), zero, rtol=0, atol=1e-11)
    assert_dual_cone_kkt(g @ g.T, DualProj().compute_weights(g @ g.T), u, 1e-13)


def test_colinear_duplicates_and_zero_rows_hand_derived() -> None:
    # Rows e₁, e₁, 2e₁, 0: the min-norm point is 0 (a zero row), the dual cone of
    # {e₁, e₁, 2e₁, 0} is {x₁ ≥ 0}, which holds the mean (1, 0)·4/4: unchanged.
    g = torch.tensor([[1.0, 0.0], [1.0, 0.0], [2.0, 0.0], [0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(MGDA()(g), torch.zeros(2, dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(DualProj()(g), torch.tensor([1.0, 0.0], dtype=F64))
    torch.testing.assert_close(UPGrad()(g), torch.tensor([1.0, 0.0], dtype=F64))
    # Rows e₁, −e₁, e₁: the dual cone is {x₁ = 0}: every projection of a row is 0.
    opposite = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [1.0, 0.0]], dtype=F64)
    for balancer in (UPGrad(), DualProj(), MGDA()):
        torch.testing.assert_close(balancer(opposite), torch.zeros(2, dtype=F64), rtol=0,
                                   atol=1e-15)


# -- properties over degenerate inputs -------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(degenerate())
def test_mgda_and_crmogm_satisfy_the_min_norm_kkt(g: Tensor) -> None:
    gram = _gram64(g)
    w = MGDA().combine(g).weights
    assert w is not None
    assert_min_norm_kkt(gram, w, _rel(g))
    # From the float64 Gramian itself (the Gramian mode's input), to float64 accuracy.
    assert_min_norm_kkt(gram, MGDA().compute_weights(gram), 1e-10)
    # CR-MOGM's first weights are its inner MGDA's; later ones stay in the simplex.
    crmogm = CRMOGM(beta=0.5)
    assert_min_norm_kkt(gram, crmogm.compute_weights(gram), 1e-10)
    later = crmogm.compute_weights(gram.flip(0).flip(1))
    assert float(later.min()) >= -1e-12 and abs(float(later.sum()) - 1) <= 1e-12


def _gramian_atol(gram: Tensor, weights: Tensor) -> float:
    """How well a Gramian fixes an update ``wᵀJ``: ``‖Jᵀv‖² = vᵀGv`` is known only to its
    rounding, ``K eps tr G ‖v‖²``, so where ``wᵀJ`` cancels (e.g. a dual cone {0}) any
    method working from ``G`` alone is exact only to ``√(K eps tr G) ‖w‖₁``."""
    k = gram.shape[0]
    trace = float(gram.trace())
    eps = torch.finfo(F64).eps
    return (k * eps * trace) ** 0.5 * max(1.0, float(weights.abs().sum())) + 1e-9 * trace**0.5


@settings(max_examples=200, deadline=None)
@given(degenerate(), st.booleans())
def test_dual_cone_methods_are_the_projection(g: Tensor, random_pref: bool) -> None:
    k = g.shape[0]
    gram = _gram64(g)
    pref = (torch.rand(k, generator=torch.Generator().manual_seed(k), dtype=F64)
            if random_pref else torch.full((k,), 1 / k, dtype=F64))
    pref = pref / pref.sum()
    # DualProj's weights solve the projection QP (KKT from the float64 Gramian); every
    # projection of UPGrad on its own does too.
    assert_dual_cone_kkt(gram, DualProj(pref=pref).compute_weights(gram), pref, 1e-10)
    unit = gram / gram.trace()
    u = torch.diag(pref)
    for i, vi in enumerate(project_dual_cone(unit, u)):
        assert_dual_cone_kkt(unit, vi, u[i], 1e-10)
    rows = g.to(F64)
    for balancer, expected in (
        (DualProj(pref=pref), nnls_dual_cone(rows, pref)),
        (UPGrad(pref=pref), sum(nnls_dual_cone(rows, u[i]) for i in range(k))),
    ):
        result = balancer.combine(g)
        assert result.weights is not None
        out = result.vector.to(F64)
        if g.dtype == F64:
            # The update is scipy's NNLS projection on the rows, to what the Gramian fixes.
            torch.testing.assert_close(out, expected, rtol=0,
                                       atol=_gramian_atol(gram, result.weights))
        else:
            # float32 rows: the solver's input is their float32-product Gramian, on which
            # the weights are optimal; no task loses beyond that rounding.
            if isinstance(balancer, DualProj):
                assert_dual_cone_kkt(compute_gramian(g), result.weights, pref, 1e-6)
            scale = float(gram.trace()) * max(1.0, float(result.weights.abs().sum()))
            assert float((rows @ out).min()) >= -1e-5 * scale


@settings(max_examples=60, deadline=None)
@given(degenerate(max_k=8, dtypes=(F64,)), st.sampled_from([0.2, 0.5, 0.9]))
def test_cagrad_is_optimal_on_degenerate_rows(g: Tensor, c: float) -> None:
    gram = _gram64(g)
    d = CAGrad(c=c)(g)
    g0 = g.mean(dim=0)
    scale = float(gram.trace())
    assert float((d - g0).norm()) <= c * float(g0.norm()) * (1 + 1e-9) + 1e-12 * scale**0.5
    # SLSQP on the primal max_d min_k gₖ·d s.t. ‖d − g₀‖ ≤ c‖g₀‖: ours at least as good.
    assert float((g @ d).min()) >= scipy_cagrad_value(g, c) - 1e-7 * scale
    # The dual's KKT: ∇ = lin + r G w/‖g_w‖ equal on the support of w, not smaller off it.
    unit = gram / gram.trace()
    k = g.shape[0]
    mean = torch.full((k,), 1.0 / k, dtype=F64)
    lin = unit @ mean
    r = c * float(mean @ lin) ** 0.5
    w = cagrad_dual(unit, c)
    assert float(w.min()) >= 0 and abs(float(w.sum()) - 1) < 1e-12
    norm = float(w @ unit @ w) ** 0.5
    if r > 1e-6 and norm > 1e-6:  # else a zero-norm combination is optimal
        grad = lin + r * (unit @ w) / norm
        nu = float(grad[w > 1e-9].mean())
        assert float((grad[w > 1e-9] - nu).abs().max()) <= 1e-8
        assert float((grad - nu).min()) >= -1e-8


def _is_infeasible(g: np.ndarray, taus: np.ndarray) -> bool:
    """No ``d`` with ``gⱼᵀd ≥ τⱼ‖gⱼ‖²`` (j ≥ 2) of a sensible length: PCD then keeps ``g₁``
    (rounding would decide such a ``d``'s direction). Sensible, as PCD documents it for a
    Gramian taken as exact (docs/balancers.md, "Solvers"): on the rows with the cosine
    matrix's eigenvalues below its cut ``r = 4·eps·K·λ_max`` dropped, an ``x = d − g₁`` within
    ``1/√r`` times the constraints' size ``max_j |bⱼ|/‖gⱼ‖`` (a factor 2 for the two solvers'
    rounding), or within ``10⁶`` times the rows. K = 12 rows of rank 1 plus 4e-7 noise: the
    shortest ``x`` 1.5 times that resolution; K = 15: one of 0.37 of it, through directions
    of eigenvalue 1.5e-14 under the cut 1.7e-13, none above it.

    Lawson & Hanson's least-distance program, by scipy's NNLS on the cleaned rows ``f`` (the
    constraints ``bⱼ = τⱼ‖gⱼ‖² − gⱼᵀg₁`` from the given rows): with ``x = d − g₁``, ``min ‖x‖``
    s.t. ``fⱼᵀx ≥ bⱼ`` has ``‖x‖² = 1/ρ² − 1`` for the residual ``ρ``
    of ``min_{u ≥ 0} ‖[Fᵀ; bᵀ]u − e‖`` (``ρ = 0``: a Farkas certificate).
    """
    from scipy.optimize import nnls as scipy_nnls

    norms = np.linalg.norm(g, axis=1)
    scale = np.where(norms > 0, norms, 1.0)
    lam, vec = np.linalg.eigh((g @ g.T) / np.outer(scale, scale))
    cut = 4 * np.finfo(np.float64).eps * g.shape[0] * float(lam[-1])
    keep = lam > cut
    rows = (vec[:, keep] * np.sqrt(lam[keep])) * (norms / norms.max())[:, None]
    rest = rows[1:]
    unit = g / norms.max()  # the constraints from the given rows, as PCD's from its Gramian
    b = taus * (unit[1:] * unit[1:]).sum(axis=1) - unit[1:] @ unit[0]
    e = np.vstack([rest.T, b[None]])
    f = np.zeros(e.shape[0])
    f[-1] = 1.0
    _, residual = scipy_nnls(e, f, maxiter=100 * e.shape[1])
    if residual <= 1e-6:  # ‖x‖ ≥ 10⁶ (the rows have length ≤ 1 here)
        return True
    size = float(np.max(np.abs(b) / np.where(norms[1:] > 0, norms[1:] / norms.max(), 1.0)))
    return bool((1.0 / residual**2 - 1.0) ** 0.5 >= 0.5 * size / cut**0.5)


@settings(max_examples=200, deadline=None)
@given(degenerate(min_k=2, max_k=16, dtypes=(F64,)), st.sampled_from([0.0, 0.05, 0.3]))
def test_pcd_kernel_satisfies_its_kkt_conditions(g: Tensor, tau: float) -> None:
    # PCD's primal min ½‖d − g₁‖² s.t. gⱼᵀd ≥ τ‖gⱼ‖², d = g₁ + Σ μⱼgⱼ: optimal iff μ ≥ 0, every
    # constraint holds and gⱼᵀd = τ‖gⱼ‖² where μⱼ > 0 (gⱼᵀd = (Gw)ⱼ, whose rounding grows
    # with ‖w‖₁: nearly colinear rows can need μ ~ 1e11). Infeasible constraints: g₁ alone,
    # and scipy's NNLS on the rows confirms that no d of a sensible length satisfies them.
    k = g.shape[0]
    gram = _gram64(g)
    taus = torch.full((k - 1,), tau, dtype=F64)
    weights = pcd_weights(gram, taus)
    assert float(weights[0]) == 1.0
    mu = weights[1:]
    slack = (gram @ weights)[1:] - taus * torch.diagonal(gram)[1:]
    trace = float(gram.trace())
    tol = 1e-9 * trace + 64 * torch.finfo(F64).eps * trace * float(weights.abs().sum())
    if not bool(mu.any()) and float(slack.min()) < -tol:
        assert _is_infeasible(g.numpy(), taus.numpy())
        return
    assert float(mu.min()) >= 0.0
    assert float(slack.min()) >= -tol
    assert float((slack.abs() * (mu > 0)).max()) <= tol


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("p", [3, 7])
def test_pcd_singular_sixteen_tasks_does_bounded_work(monkeypatch: pytest.MonkeyPatch,
                                                      seed: int, p: int) -> None:
    # K = 16 with rank ≤ 7: one NNLS of 15 variables within its addition budget (3n + 10),
    # no fallback; the enumeration it replaces visited up to 2¹⁵ working sets.
    calls: list[_boxqp.NNLSResult] = []

    def spy(*args: object, **kwargs: object) -> _boxqp.NNLSResult:
        result = nnls(*args, **kwargs)  # type: ignore[arg-type]
        calls.append(result)
        return result

    monkeypatch.setattr(_boxqp, "nnls", spy)
    g = torch.randn(16, p, generator=torch.Generator().manual_seed(seed), dtype=F64)
    g[0] *= 3
    out = PCD(tau=0.1, beta=0.9)(g)
    assert len(calls) == 1
    assert calls[0].additions <= 3 * 15 + 10 and calls[0].fallback_steps == 0
    assert calls[0].solves <= 2 * calls[0].additions + 15
    assert bool(torch.isfinite(out).all())


# -- the NNLS core and its fallback --------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.integers(1, 16), st.integers(0, 2**31 - 1), st.booleans())
def test_nnls_matches_scipy(m: int, n: int, seed: int, dependent: bool) -> None:
    from scipy.optimize import nnls as scipy_nnls

    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, n, generator=gen, dtype=F64)
    if dependent and n > 2:
        a[:, 1] = 2 * a[:, 0]
        a[:, -1] = a[:, 0] - a[:, 1] / 4
    b = torch.randn(m, generator=gen, dtype=F64)
    result = nnls(a, b)
    ref, _ = scipy_nnls(a.numpy(), b.numpy(), maxiter=100 * n)
    assert float(result.x.min()) >= 0.0
    expected = float(np.linalg.norm(a.numpy() @ ref - b.numpy()))
    assert float((a @ result.x - b).norm()) == pytest.approx(expected, rel=1e-12, abs=1e-13)
    # KKT: w = Aᵀ(b − Ax) ≤ 0, and 0 where x > 0.
    w = a.T @ (b - a @ result.x)
    assert float(w.max()) <= 1e-10 and float((w * result.x).abs().max()) <= 1e-10
    assert result.fallback_steps == 0 and result.additions <= 3 * n + 10


@pytest.mark.parametrize("seed", range(4))
def test_fallback_reaches_the_optimum(seed: int) -> None:
    # No active-set additions allowed: FISTA alone, then the polish from its support; the
    # answer is the same point (scipy's NNLS as the reference).
    from scipy.optimize import nnls as scipy_nnls

    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(5, 9, generator=gen, dtype=F64)  # more columns than rows
    b = torch.randn(5, generator=gen, dtype=F64)
    result = nnls(a, b, max_additions=0)
    assert result.fallback_steps == FALLBACK_ITERATIONS
    ref, _ = scipy_nnls(a.numpy(), b.numpy(), maxiter=1000)
    expected = float(np.linalg.norm(a.numpy() @ ref - b.numpy()))
    assert float((a @ result.x - b).norm()) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_fista_meets_its_bound(seed: int) -> None:
    # Beck & Teboulle's Theorem 4.4: f(x_N) − f* ≤ 2 L ‖x₀ − x*‖² / (N + 1)², f = ½‖Ax − b‖².
    from scipy.optimize import nnls as scipy_nnls

    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(6, 10, generator=gen, dtype=F64) @ torch.diag(
        torch.logspace(0, -4, 10, dtype=F64))  # badly scaled columns
    b = torch.randn(6, generator=gen, dtype=F64)
    ref, _ = scipy_nnls(a.numpy(), b.numpy(), maxiter=1000)
    x_star = torch.from_numpy(ref)
    lip = float(torch.linalg.matrix_norm(a, ord=2)) ** 2
    for steps in (10, 100):
        x = _boxqp._fista(a, b, torch.zeros(10, dtype=F64), steps)
        gap = 0.5 * float((a @ x - b).norm() ** 2) - 0.5 * float((a @ x_star - b).norm() ** 2)
        assert float(x.min()) >= 0.0
        assert gap <= 2 * lip * float(x_star.norm() ** 2) / (steps + 1) ** 2 + 1e-12


def test_min_norm_of_coincident_and_zero_points() -> None:
    # Hand-derived: points e₁, e₁, −e₁ → 0 is in the hull (w puts ½ on −e₁); all points at
    # the origin → any w, a valid simplex point is returned.
    gram = torch.tensor([[1.0, 1.0, -1.0], [1.0, 1.0, -1.0], [-1.0, -1.0, 1.0]], dtype=F64)
    w = min_norm_simplex(gram / 3)
    assert float(w @ gram @ w) <= 1e-15 and float(w[2]) == pytest.approx(0.5)
    zero = min_norm_simplex(torch.zeros(3, 3, dtype=F64))
    assert float(zero.min()) >= 0 and float(zero.sum()) == pytest.approx(1.0)
