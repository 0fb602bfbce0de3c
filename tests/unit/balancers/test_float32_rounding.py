"""Rules that invert the Gramian, on float32 rows whose Gramian carries float32's rounding.

A Gramian multiplied in float32 carries ``1e-7 … 1e-5`` of ``‖gᵢ‖‖gⱼ‖`` of rounding
(:func:`~gradbalance.gramian.products_rounding`), so two tasks opposite within float32's
rounding (a gradient reversal ``g``, ``−λg``) or rows of a rank-deficient span leave cosine
eigenvalues of that size where the exact ones are zero. ConFIG, IMTL-G, Aligned-MTL, Nash-MTL,
CAGrad and PCD inverted that noise: updates as far from the exact ones as the updates
themselves. They now read the Gramian without it (docs/balancers.md, "Numerical range").

The references are independent of the library, on the float64 values of the same rows with the
reversal made exactly parallel: numpy's SVD pseudo-inverse of the rows (ConFIG, IMTL-G,
Aligned-MTL), Nash-MTL's defining equation, SLSQP on CAGrad's primal, PCD's documented
answer for infeasible constraints (``g₁``).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import Tensor

from gradbalance.balancers import IMTLG, PCD, AlignedMTL, CAGrad, ConFIG, NashMTL
from gradbalance.balancers._denoise import without_rounding
from gradbalance.gramian import compute_gramian, products_rounding
from support.balancers import check_cagrad_zero_optimum, scipy_cagrad_value

F64 = torch.float64
CASES = [(k, seed, lam) for k in (4, 8, 16, 40) for seed in range(4) for lam in (0.1, 2.5)]
#: float32 against the float64 references: the update's own rounding (a float32 ``wᵀG`` and
#: ``1e-7`` of the rows) times the problems' conditioning; 6e-6 measured at most.
TOL = 2e-5


def reversal_rows(k: int, seed: int, lam: float, p: int = 300) -> tuple[Tensor, Tensor]:
    """``(rows, model)``: ``[K, P]`` float32 rows, ``K − 2`` conflicting ones, ``g`` and
    ``−λg`` (rounded to float32), and their float64 values with the last row exactly
    parallel to ``g`` (``−(‖r‖/‖g‖) g``: the exact reversal the float32 row rounds)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(p, generator=gen, dtype=F64)
    others = torch.randn(k - 2, 1, generator=gen, dtype=F64) * shared
    others = others + 0.5 * torch.randn(k - 2, p, generator=gen, dtype=F64)
    g = torch.randn(p, generator=gen, dtype=F64)
    rows = torch.cat([others, g[None], -lam * g[None]]).float()
    model = rows.double()
    model[-1] = -(model[-1].norm() / model[-2].norm()) * model[-2]
    return rows, model


def config_reference(a: np.ndarray) -> np.ndarray:
    """ConFIG (Liu et al. 2024, eq. 2) from the rows: ``ĝ ∝ U⁺1``, ``g = (Σₖ gₖ·ĝ) ĝ``."""
    unit = a / np.linalg.norm(a, axis=1, keepdims=True)
    direction = np.linalg.pinv(unit, rcond=1e-10) @ np.ones(len(a))
    direction /= np.linalg.norm(direction)
    return (a @ direction).sum() * direction


def imtlg_reference(a: np.ndarray) -> np.ndarray:
    """IMTL-G's ``Jᵀw``, ``w = G⁺d / 1ᵀG⁺d``: ``J⁺d / (J⁺1)ᵀ(J⁺d)`` (``G⁺ = J⁺ᵀJ⁺``)."""
    inverse = np.linalg.pinv(a, rcond=1e-10)
    toward = inverse @ np.linalg.norm(a, axis=1)
    return toward / float((inverse @ np.ones(len(a))) @ toward)


def alignedmtl_reference(a: np.ndarray) -> np.ndarray:
    """Aligned-MTL's ``Jᵀ B 1``, ``B = σ_min U Σ⁻¹ Uᵀ`` over the rows' non-zero singular
    values (``J = UΣVᵀ``)."""
    u, s, _ = np.linalg.svd(a, full_matrices=False)
    kept = s > 1e-10 * s[0]
    u, s = u[:, kept], s[kept]
    weights = s.min() * (u / s) @ (u.T @ np.ones(len(a)))
    return a.T @ weights


def _close(update: Tensor, expected: np.ndarray, rows: Tensor) -> float:
    """``‖update − expected‖`` relative to the larger of the expected update's norm and
    ``1e-3`` of the longest row."""
    scale = max(float(np.linalg.norm(expected)), 1e-3 * float(rows.double().norm(dim=1).max()))
    return float(np.linalg.norm(update.double().numpy() - expected)) / scale


@pytest.mark.parametrize(("k", "seed", "lam"), CASES)
@pytest.mark.parametrize(("balancer", "reference"), [
    (ConFIG, config_reference), (IMTLG, imtlg_reference), (AlignedMTL, alignedmtl_reference),
])
def test_pseudo_inverse_rules_on_a_float32_reversal(balancer: type, reference: object,
                                                    k: int, seed: int, lam: float) -> None:
    rows, model = reversal_rows(k, seed, lam)
    expected = reference(model.numpy())  # type: ignore[operator]
    assert _close(balancer()(rows), expected, rows) <= TOL


@pytest.mark.parametrize(("k", "seed", "lam"), CASES)
def test_nashmtl_on_a_float32_reversal_solves_the_ridge_equation(k: int, seed: int,
                                                                 lam: float) -> None:
    # g and −λg: no non-negative α has αₖ(gₖ·g) = 1 for both, so Nash-MTL solves the ridge
    # (G + 1e-6 tr G · I) α = 1/α (no_solution="ridge", with its warning); the weights are α.
    rows, model = reversal_rows(k, seed, lam)
    with pytest.warns(RuntimeWarning, match="no solution"):
        weights = NashMTL().combine(rows).weights
    assert weights is not None
    gram = model @ model.T
    ridge = gram + 1e-6 * float(gram.trace()) * torch.eye(k, dtype=F64)
    residual = ridge @ weights - 1.0 / weights
    # The ridge 1e-6 tr G is within 3× of float32's rounding of G: its solution carries
    # 1e-4 of it (4.1e-5 measured); before, 0.12 … 0.64 off and 13 of 32 without a warning.
    assert float(residual.norm()) <= 2e-4 * float((1.0 / weights).norm())


def check_cagrad(model: Tensor, d: Tensor, tol: float) -> bool:
    """CAGrad's update ``d`` on the rows ``model`` (c = 0.4) against SLSQP on its primal
    ``max_d min gₖ·d`` s.t. ``‖d − g₀‖ ≤ c‖g₀‖``: where the optimum is 0 (``g_w = 0`` in
    the dual: the pair cancels) the update is the conflict-free one closest to ``g₀``
    (:func:`~support.balancers.check_cagrad_zero_optimum`; docs), else the worst task's
    improvement is SLSQP's within ``tol`` of its scale, inside the ball. Returns whether the
    optimum was 0."""
    if check_cagrad_zero_optimum(model, d, tol):
        return True
    g0 = model.mean(dim=0)
    scale = float(model.norm(dim=1).max() * g0.norm())
    value = scipy_cagrad_value(model, 0.4)
    assert float((model @ d).min()) >= value - tol * scale
    assert float((d - g0).norm()) <= 0.4 * float(g0.norm()) * (1 + tol)
    return False


@pytest.mark.parametrize(("k", "seed", "lam"), CASES)
def test_cagrad_on_a_float32_reversal_meets_its_primal(k: int, seed: int, lam: float) -> None:
    # Before, K = 40 seed 3 λ = 0.1 was 33 % off: weights 27 and 273 on the pair.
    rows, model = reversal_rows(k, seed, lam)
    check_cagrad(model, CAGrad(c=0.4)(rows).double(), TOL)


@pytest.mark.parametrize(("k", "seed", "lam"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_pcd_with_a_reversed_secondary_task_follows_the_primary(k: int, seed: int, lam: float,
                                                                dtype: torch.dtype) -> None:
    # Secondary tasks g and −λg with τ = 0.02: gᵀd ≥ τ‖g‖² and gᵀd ≤ −λτ‖g‖² cannot both
    # hold, so PCD's update is g₁ (docs). Before: float32 updates 0.4 … 0.2 of ‖g₁‖ in other
    # directions; float64 rows opposite within float32's rounding an update of 0.
    rows, model = reversal_rows(k, seed, lam)
    given = rows if dtype == torch.float32 else rows.double()
    update = PCD()(given).double()
    assert float((update - model[0]).norm()) <= TOL * float(model[0].norm())


@pytest.mark.parametrize("k", [8, 16, 40])
@pytest.mark.parametrize("rank", ["quarter", "half"])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(("balancer", "reference"), [
    (ConFIG, config_reference), (IMTLG, imtlg_reference), (AlignedMTL, alignedmtl_reference),
])
def test_pseudo_inverse_rules_on_float32_rows_of_a_smaller_span(
        balancer: type, reference: object, k: int, rank: str, seed: int) -> None:
    # K rows in a span of rank K/4 or K/2, rounded to float32: the reference drops the
    # rounding's singular values (1e-8 of the largest) from the rows themselves. Before,
    # every case was 100 % off: the float32 Gramian's 1e-7 eigenvalues were inverted.
    gen = torch.Generator().manual_seed(seed)
    r = k // 4 if rank == "quarter" else k // 2
    rows = (torch.randn(k, r, generator=gen, dtype=F64)
            @ torch.randn(r, 300, generator=gen, dtype=F64)).float()
    a = rows.double().numpy()
    u, s, vt = np.linalg.svd(a, full_matrices=False)
    exact = (u[:, :r] * s[:r]) @ vt[:r]  # the rank-r rows the float32 ones round
    assert s[r] <= 1e-6 * s[0] < s[r - 1]  # the premise: rank r to float32's rounding
    assert _close(balancer()(rows), reference(exact), rows) <= 1e-4  # type: ignore[operator]


def test_products_rounding_bounds_a_pairs_measured_rounding() -> None:
    # 1 + cos(g, −λg) of the float32 Gramian, which is 0 exactly: below the bound at every P.
    for p in (100, 3_000, 100_000):
        gen = torch.Generator().manual_seed(p)
        g = torch.randn(p, generator=gen)
        worst = 0.0
        for lam in (0.1, 0.7, 2.5):
            gram = compute_gramian(torch.stack([g, -lam * g]))
            worst = max(worst, abs(1.0 + float(gram[0, 1] / (gram[0, 0] * gram[1, 1]).sqrt())))
        assert 0.0 < worst <= products_rounding(torch.empty(2, p))


def test_products_rounding_reads_dtypes_and_sizes() -> None:
    eps = torch.finfo(torch.float32).eps
    assert products_rounding(torch.zeros(3, 10, dtype=F64)) == 0.0
    assert products_rounding(torch.zeros(3, 10)) == 3 * eps  # the floor: max(3, √10/8)
    assert products_rounding(torch.zeros(3, 6400, dtype=torch.bfloat16)) == 10 * eps
    params = [torch.zeros(40, 40), torch.zeros(2400, dtype=F64)]  # 4,000 entries
    assert products_rounding(params) == pytest.approx(eps * 4000**0.5 / 8)
    assert products_rounding([torch.zeros(5, dtype=F64)]) == 0.0
    assert products_rounding(torch.zeros(2, 10**7)) == products_rounding(torch.zeros(2, 2**20))


def test_without_rounding_zeroes_the_rounding_and_keeps_the_rest() -> None:
    # Three rows in a plane (cosine eigenvalue 0) with 1e-7 of noise in the Gramian: the
    # cleaned Gramian has that eigenvalue at zero and differs by at most the cut.
    a = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [3.0, -4.0, 0.0]], dtype=F64)
    gram = a @ a.T
    norms = gram.diagonal().sqrt()
    noisy = gram + 1e-7 * torch.outer(norms, norms) * torch.tensor(
        [[0.0, 1.0, -1.0], [1.0, 0.0, 2.0], [-1.0, 2.0, 0.0]], dtype=F64)
    cleaned = without_rounding(noisy, 1e-6)
    cosine = cleaned / torch.outer(norms, norms)
    lam = torch.linalg.eigvalsh(cosine)
    assert abs(float(lam[0])) <= 1e-15
    assert float(((cleaned - noisy) / torch.outer(norms, norms)).abs().max()) <= 1e-6
    well = torch.eye(3, dtype=F64) + 0.1
    assert without_rounding(well, 1e-6) is well  # nothing below the cut: unchanged
    assert without_rounding(noisy, 0.0) is noisy  # float64 products: taken as exact
    zero_row = torch.zeros(4, 4, dtype=F64)
    zero_row[:3, :3] = noisy
    out = without_rounding(zero_row, 1e-6)
    assert bool((out[3] == 0).all() & (out[:, 3] == 0).all())
    assert torch.allclose(out[:3, :3], cleaned, rtol=0, atol=1e-14)


def test_cagrad_zero_norm_optimum_found_a_little_above_zero_is_the_zero_optimum() -> None:
    # float64 rows, a task and its reversal −λg among six conflicting ones: the dual's optimum
    # is g_w = 0 (the conflict-free update closest to g₀), which its QPs reach only to
    # ‖g_w‖² ≈ 1e-14 of the span:
    # before, weights 1.7e6 and 5.8e6 (λ = 0.3), 1.1e6 and 4.5e5 (λ = 2.5) on the pair and
    # the rounding's direction.
    gen = torch.Generator().manual_seed(34)
    shared = torch.randn(300, generator=gen, dtype=F64)
    rows = torch.randn(6, 1, generator=gen, dtype=F64) * shared
    rows = rows + 0.5 * torch.randn(6, 300, generator=gen, dtype=F64)
    g = torch.randn(300, generator=gen, dtype=F64)
    zero = []
    for lam in (0.1, 0.3, 1.0, 2.5):
        m = torch.cat([rows, g[None], -lam * g[None]])
        out = CAGrad(c=0.4).combine(m)
        assert out.weights is not None and float(out.weights.abs().max()) <= 10.0
        if check_cagrad(m, out.vector, 1e-9):
            zero.append(lam)
    assert {0.3, 2.5} <= set(zero)  # the premise: those two optima are 0


@pytest.mark.parametrize("mode", ["matrix", "gramian"])
@pytest.mark.parametrize("seed", range(3))
def test_every_route_removes_the_rounding_of_a_float32_model(mode: str, seed: int) -> None:
    # Four losses on a float32 MLP, the last the reversal of the first (−0.1 l₀): ConFIG's
    # trunk update within float32's rounding of the float64 model's in both modes (the
    # buffer's Gramian and the combine's each carry products_rounding of the trunk).
    from gradbalance import TaskGradBuffer
    from gradbalance_lab.models import regression_losses
    from support.helpers import build

    updates = {}
    for dtype in (torch.float32, F64):
        model, x, y = build("mlp", num_tasks=3, batch=8, seed=seed, dtype=dtype)
        kwargs = {"modules": model.trunk} if mode == "gramian" and dtype == torch.float32 else {}
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                             mode=mode if dtype == torch.float32 else "matrix", **kwargs)
        losses = regression_losses(model(x), y)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            buf.backward(torch.cat([losses, -0.1 * losses[:1]]))
        buf.apply_(ConFIG())
        updates[dtype] = torch.cat([p.grad.flatten().double() for p in model.shared_parameters()])
    expected = updates[F64]
    assert float((updates[torch.float32] - expected).norm()) <= 1e-4 * float(expected.norm())


@pytest.mark.parametrize("seed", range(3))
def test_the_per_sample_step_removes_the_rounding_of_a_float32_model(seed: int) -> None:
    # Per-sample objectives (batch_dim=0) of a float32 MLP, the last sample a copy of the
    # first with its loss times −0.1: ConFIG's update within float32's rounding of the
    # float64 model's, the same objectives passed as tasks of the matrix route.
    from gradbalance import TaskGradBuffer

    updates = {}
    for dtype in (torch.float32, F64):
        torch.manual_seed(seed)
        trunk = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 8)).to(dtype)
        heads = torch.nn.Linear(8, 1).to(dtype)
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(6, 6, generator=gen).to(dtype)
        x = torch.cat([x, x[:1]])
        y = torch.randn(7, generator=gen).to(dtype)
        y[-1] = y[0]  # the copy's gradient: −0.1 times the first sample's
        per_sample = dtype == torch.float32
        kwargs = {"modules": trunk, "batch_dim": 0} if per_sample else {}
        buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()), **kwargs)
        losses = (heads(trunk(x))[:, 0] - y) ** 2
        losses = losses * torch.tensor([1.0] * 6 + [-0.1], dtype=dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            buf.backward(losses)
        buf.apply_(ConFIG())
        if per_sample:
            assert buf._per_sample is not None
            buf._per_sample.gramian.remove()
        updates[dtype] = torch.cat([p.grad.flatten().double() for p in trunk.parameters()])
    expected = updates[F64]
    assert float((updates[torch.float32] - expected).norm()) <= 1e-4 * float(expected.norm())


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("balancer", [IMTLG, PCD, AlignedMTL, CAGrad, ConFIG, NashMTL])
def test_all_zero_float32_rows_give_zero(balancer: type, k: int) -> None:
    # Every row zero: the cut has no cosine matrix to read (an IndexError before this test).
    rows = torch.zeros(k, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        update = balancer()(rows)
    assert bool((update == 0).all())


def test_a_zero_row_keeps_the_cut_on_its_cheap_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # Zero rows are identity rows of the definiteness check: a positive definite cosine
    # matrix among them is not decomposed (tasks without a gradient are common).
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda a: calls.append(a.shape) or eigh(a))
    gram = torch.eye(4, dtype=F64) + 0.2
    gram[1] = 0.0
    gram[:, 1] = 0.0
    assert without_rounding(gram, 1e-6) is gram
    assert without_rounding(torch.zeros(3, 3, dtype=F64), 1e-6).abs().max() == 0
    assert calls == []


@pytest.mark.parametrize("seed", range(40))
def test_mixed_structures_stay_finite(seed: int) -> None:
    # Random K ≤ 20 rows with reversals (−0.1, −1, −2.5 times an earlier row), copies, zero
    # rows and norms e^{±5}, float32 and float64: every rule that inverts the Gramian returns
    # a finite update (a documented SolverError aside).
    import random

    from gradbalance.balancers import CRMOGM, SolverError

    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    k, p = rnd.randint(1, 20), rnd.choice([3, 10, 50, 300])
    m = torch.randn(k, p, generator=gen, dtype=F64)
    for i in range(1, k):
        r = rnd.random()
        if r < 0.15:
            m[i] = -rnd.choice([0.1, 2.5, 1.0]) * m[rnd.randrange(i)]
        elif r < 0.25:
            m[i] = rnd.choice([1.0, 3.0]) * m[rnd.randrange(i)]
        elif r < 0.3:
            m[i] = 0.0
    m = m * torch.exp(5 * torch.randn(k, 1, generator=gen, dtype=F64))
    for rows in (m.float(), m):
        for make in (IMTLG, PCD, AlignedMTL, CAGrad, ConFIG, NashMTL, lambda: CRMOGM(ConFIG())):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    update = make()(rows)
            except SolverError:
                continue
            assert bool(torch.isfinite(update).all())


@pytest.mark.parametrize("k", [16, 70])
@pytest.mark.parametrize("shape", ["half", "eighth", "copies"])
@pytest.mark.parametrize("balancer", [IMTLG, AlignedMTL, CAGrad, PCD])
def test_the_cut_spectrum_gives_the_rules_their_own_decomposition(balancer: type, k: int,
                                                                  shape: str) -> None:
    # Where the cut removes directions, IMTL-G, Aligned-MTL, CAGrad and PCD start from its
    # spectrum (G' = DVΛVᵀD) instead of decomposing G' again: the same weights as their own
    # decomposition of G' (a second route), to its rounding. K = 70 takes CAGrad's and PCD's
    # many-task paths.
    from gradbalance.balancers._denoise import cleaned

    gen = torch.Generator().manual_seed(k)
    if shape == "copies":
        half = torch.randn(k // 2, 400, generator=gen, dtype=F64)
        rows = torch.cat([half, 2.0 * half]).float()
    else:
        r = k // 2 if shape == "half" else k // 8
        rows = (torch.randn(k, r, generator=gen, dtype=F64)
                @ torch.randn(r, 400, generator=gen, dtype=F64)).float()
    rounding = products_rounding(rows)
    gram, spectrum = cleaned(compute_gramian(rows), rounding)
    assert spectrum is not None  # the premise: directions were cut
    fast = balancer()._rounded_weights(gram, None, rounding, spectrum)
    slow = balancer()._rounded_weights(gram, None, rounding, None)
    a, b = fast @ rows.double(), slow @ rows.double()
    assert float((a - b).norm()) <= 1e-8 * float(b.norm())


# -- the lift of a cleaned Gramian (CAGrad's and PCD's few-cut path) -----------------------
#: Rows in a span of rank ``K − q`` (``q`` cut directions, at most a quarter of the rows:
#: :meth:`~gradbalance.balancers._denoise.KeptSpectrum.lift`) from 64 tasks on.
LIFT_CASES = [(k, q, seed) for k in (64, 96) for q in (1, 3, 12) for seed in range(2)]
#: CAGrad lifts up to half the directions cut (``_cagrad.LIFT_MAX_NULLITY``).
CAGRAD_LIFT_CASES = LIFT_CASES + [(k, q, seed) for k in (64, 96) for q in (3 * k // 8, k // 2)
                                  for seed in range(2)]


def span_model(k: int, nullity: int, seed: int, p: int = 300) -> tuple[Tensor, Tensor]:
    """``(rows, model)``: float32 rows in a random span of rank ``K − nullity`` and the
    float64 model they round (the span exact)."""
    gen = torch.Generator().manual_seed(seed)
    r = k - nullity
    model = torch.randn(k, r, generator=gen, dtype=F64) @ torch.randn(r, p, generator=gen,
                                                                      dtype=F64)
    return model.float(), model


def _lift_route(monkeypatch: pytest.MonkeyPatch, module: object, name: str,
                call: object) -> tuple[Tensor, Tensor, list[bool]]:
    """``call()`` with ``module.name`` spied (whether it answered) and again with it
    refusing (the least squares on the factor of the cleaned Gramian: a second route)."""
    original = getattr(module, name)
    taken: list[bool] = []

    def spy(*args: object) -> object:
        out = original(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(module, name, spy)
    lifted = call()  # type: ignore[operator]
    monkeypatch.setattr(module, name, lambda *args: None)
    factored = call()  # type: ignore[operator]
    return lifted, factored, taken


@pytest.mark.parametrize(("k", "nullity", "seed"), CAGRAD_LIFT_CASES)
def test_cagrad_lift_of_a_cleaned_gramian_is_exact(monkeypatch: pytest.MonkeyPatch, k: int,
                                                   nullity: int, seed: int) -> None:
    # The dual on G' + εD², its support solved on G' itself: the factor's answer (1e-10)
    # and SLSQP's on the float64 span.
    from gradbalance.balancers import _solvers

    rows, model = span_model(k, nullity, seed)
    lifted, factored, taken = _lift_route(
        monkeypatch, _solvers, "_lifted_cagrad", lambda: CAGrad(c=0.4)(rows).double())
    assert taken == [True]
    assert float((lifted - factored).norm()) <= 1e-10 * float(factored.norm())
    assert not check_cagrad(model, lifted, TOL)


@pytest.mark.parametrize(("k", "nullity", "seed"), [c for c in LIFT_CASES if c[1] > 1])
def test_pcd_lift_of_a_cleaned_gramian_is_exact(monkeypatch: pytest.MonkeyPatch, k: int,
                                                nullity: int, seed: int) -> None:
    # PCD's dual QP on G' + εD², then on G' over its support: the factor's least-distance
    # answer (1e-10) and scipy's NNLS of the program on the float64 span. (One cut direction
    # leaves the secondary Gramian of K − 1 rows positive definite: no singular path.)
    from gradbalance.balancers import _pcd
    from gradbalance.balancers._denoise import cleaned
    from gradbalance.functional import pcd_weights
    from support.balancers import scipy_pcd

    rows, model = span_model(k, nullity, seed)
    rounding = products_rounding(rows)
    gram, spectrum = cleaned(compute_gramian(rows).double(), rounding)
    assert spectrum is not None and spectrum.lift() is not None
    taus = torch.full((k - 1,), 0.02, dtype=F64)
    lifted, factored, taken = _lift_route(
        monkeypatch, _pcd, "_lifted_exact",
        lambda: pcd_weights(gram, taus, rounding=rounding, factor=spectrum.factor(),
                            lift=spectrum.lift()) @ model)
    assert taken == [True]
    assert float((lifted - factored).norm()) <= 1e-10 * float(factored.norm())
    reference = scipy_pcd(model, 0.02)
    assert float((lifted - reference).norm()) <= TOL * float(reference.norm())


@pytest.mark.parametrize("k", [64, 96])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("lam", [0.1, 2.5])
def test_the_lift_leaves_a_reversal_to_the_factor(monkeypatch: pytest.MonkeyPatch, k: int,
                                                  seed: int, lam: float) -> None:
    # A reversal among K ≥ 64 rows: one cut direction, so the lift applies, but the
    # vanishing combination (g, −λg) is where it would move the answer. CAGrad meets its
    # primal (where the optimum is 0, the conflict-free update closest to g₀) and PCD keeps
    # g₁, as below 64 tasks.
    rows, model = reversal_rows(k, seed, lam)
    check_cagrad(model, CAGrad(c=0.4)(rows).double(), TOL)
    update = PCD()(rows).double()
    assert float((update - model[0]).norm()) <= TOL * float(model[0].norm())


@pytest.mark.parametrize("k", [16, 64, 96])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("lam", [0.1, 2.5])
def test_a_float32_gramian_keeps_its_cut_directions_null(k: int, seed: int, lam: float) -> None:
    # A Gramian handed to compute_weights in float32 with its products' rounding: the cleaned
    # Gramian stays float64 (rounded back to float32, the reversal's cut direction carried
    # float32's rounding again, and CAGrad and PCD inverted it: 11 of these 48 cases off).
    rows, model = reversal_rows(k, seed, lam)
    gram = compute_gramian(rows).float()
    rounding = products_rounding(rows)
    check_cagrad(model, CAGrad(c=0.4).compute_weights(gram, rounding=rounding) @ model, TOL)
    update = PCD().compute_weights(gram, rounding=rounding) @ model
    assert float((update - model[0]).norm()) <= TOL * float(model[0].norm())
