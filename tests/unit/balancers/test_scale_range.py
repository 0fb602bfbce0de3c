"""Numerical range: every registered balancer gives its float64 answer for rows of norm
``1e-30`` … ``1e30``, in float32 and float64, and never calls a finite input non-finite.

The references never touch the scale-safe code (``gradbalance.gramian``, the base class's
normalisation): a weighted method's own weight rule on the plain float64 Gramian
``g @ g.T`` of the float64 rows, a textbook float64 implementation for the matrix methods
and for the methods whose state or step is in gradient units. A method with a scaling law
``B(sJ) = s^a B(J)`` (its declared ``homogeneous_degree``) is compared with ``s^a`` times
its answer on the unit-scale rows (the input's own values divided by ``s``); the others
(MoCo, MoDo, PCD, ExcessMTL: a step size or an ``ε`` in gradient units) with their float64
answer at the same scale.

Before the fix (same grid as ``test_extreme_scales_regression``): float32 rows of norm above
~1.8e19 raised ``NonFiniteGradientError`` in 20 balancers, 1e-30 rows gave zero updates or
wrong directions in 16, ExcessMTL was wrong at both ends, and MoCo/MoDo raised from the
projection for row norms ≥ 1e10 in float64 too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import gradbalance
from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, Balancer, MoCo, MoDo, Sum, UPGrad
from gradbalance.gramian import compute_gramian, cosine_matrix, linear_gramian, unit_rows
from support.balancers import build_balancer

NAMES = sorted(gradbalance.BALANCERS)


# -- references (float64, no library Gramian code) ----------------------------------------
def project_simplex_bisect(v: Tensor) -> Tensor:
    """``argmin_{w∈Δ} ‖w − v‖`` by bisection on ``θ`` in ``Σ max(v − θ, 0) = 1``."""
    v = v - v.max()
    lo, hi = -1.0, 0.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if float((v - mid).clamp_min(0).sum()) > 1.0 else (lo, mid)
    w = (v - hi).clamp_min(0)
    return w / w.sum()


class Reference:
    """One float64 run of a method: ``__call__(rows, losses)`` → the update."""

    def __init__(self, balancer: Balancer, dtype: torch.dtype) -> None:
        self.b, self.dtype = balancer, dtype
        self.state: dict[str, Any] = {}

    def __call__(self, g: Tensor, losses: Tensor) -> Tensor:
        rule = getattr(self, "_" + self.b.name, None)
        if rule is not None:
            out: Tensor = rule(g, losses)
            return out
        assert self.b.from_gramian, self.b.name
        return self.b._compute_weights(g @ g.T, losses).to(torch.float64) @ g

    def _step(self) -> int:
        self.state["t"] = self.state.get("t", 0) + 1
        return int(self.state["t"])

    def _moco(self, g: Tensor, losses: Tensor) -> Tensor:
        b = self.b
        assert isinstance(b, MoCo)
        t = self._step()
        k = g.shape[0]
        y = self.state.get("y", torch.zeros_like(g))
        lam = self.state.get("lam", torch.full((k,), 1.0 / k, dtype=torch.float64))
        y = y - b.beta / t**b.beta_sigma * (y - g)
        step = lam - b.gamma / t**b.gamma_sigma * (y @ y.T @ lam + b.rho * lam)
        self.state.update(y=y, lam=project_simplex_bisect(step))
        return self.state["lam"] @ y

    def _modo(self, g: Tensor, losses: Tensor) -> Tensor:
        b = self.b
        assert isinstance(b, MoDo)
        k = g.shape[0]
        lam = self.state.get("lam", torch.full((k,), 1.0 / k, dtype=torch.float64))
        lam = project_simplex_bisect(lam - b.gamma * ((g @ g.T) @ lam + b.rho * lam))
        self.state["lam"] = lam
        return lam @ g

    def _excessmtl(self, g: Tensor, losses: Tensor) -> Tensor:
        b: Any = self.b
        k = g.shape[0]
        sq = self.state["sq"] + g * g if "sq" in self.state else g * g
        risks = (g * g / torch.sqrt(sq + b.eps)).sum(dim=1)
        base = self.state.setdefault("base", risks)
        w = self.state.get("w", torch.full((k,), 1.0 / k, dtype=torch.float64))
        w = torch.softmax(torch.log(w) + b.robust_step_size * risks / base, dim=0)
        self.state.update(sq=sq, w=w)
        return w @ g

    def _dbmtl(self, g: Tensor, losses: Tensor) -> Tensor:
        b: Any = self.b
        t = self._step()
        beta = b.beta / t**b.beta_sigma
        ema = (1 - beta) * g if "ema" not in self.state else beta * self.state["ema"] + (
            1 - beta) * g
        self.state["ema"] = ema
        norms = ema.norm(dim=1)
        return (norms.max() / norms) @ ema

    def _graddrop(self, g: Tensor, losses: Tensor) -> Tensor:
        # The balancer draws its uniforms in the input's dtype: draw the same ones.
        u = torch.rand(g.shape[1], generator=self.b.generator, dtype=self.dtype).double()
        purity = 0.5 * (1 + g.sum(0) / g.abs().sum(0))
        keep = ((purity > u) & (g > 0)) | ((purity < u) & (g < 0))
        return (keep.double() * g).sum(0)

    def _trimmedmean(self, g: Tensor, losses: Tensor) -> Tensor:
        t = self.b.trim_number  # type: ignore[attr-defined]
        return torch.sort(g, dim=0).values[t : g.shape[0] - t].mean(dim=0)


# -- the comparison -----------------------------------------------------------------------
def rows(seed: int, k: int, p: int, conflict: bool) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(k, p, generator=gen, dtype=torch.float64)
    if conflict:
        g[-1] -= 1.5 * g[0]
    return g


def losses_for(seed: int, k: int) -> Tensor:
    gen = torch.Generator().manual_seed(10_000 + seed)
    return torch.rand(k, generator=gen, dtype=torch.float64) + 0.5


def assert_matches(out: Tensor, ref: Tensor, rtol: float, context: str) -> None:
    """Cosine ≥ 0.999 and the same norm to ``rtol``; a zero reference needs a zero update."""
    out = out.double()
    assert bool(torch.isfinite(out).all()), f"non-finite update ({context})"
    ref_norm, out_norm = float(ref.norm()), float(out.norm())
    if ref_norm == 0.0:
        assert out_norm == 0.0, context
        return
    assert out_norm > 0.0, f"zero update ({context})"
    cos = float(out @ ref) / (out_norm * ref_norm)
    assert cos >= 0.999, f"cosine {cos} ({context})"
    assert abs(out_norm / ref_norm - 1.0) <= rtol, f"norm {out_norm / ref_norm} ({context})"


def check_scale(name: str, k: int, p: int, seed: int, scale: float, dtype: torch.dtype,
                conflict: bool = True, steps: int = 2) -> None:
    """``steps`` calls of the balancer on rows of norm ~``scale`` vs the float64 reference."""
    tested, ref = build_balancer(name, k, seed), Reference(build_balancer(name, k, seed), dtype)
    a = tested.homogeneous_degree  # None: compared at the same scale
    for step in range(steps):
        g_in = (rows(100 * seed + step, k, p, conflict) * scale).to(dtype)
        losses = losses_for(step, k)
        g64 = g_in.double()
        expected = ref(g64, losses) if a is None else ref(g64 / scale, losses) * scale**a
        out = tested(g_in, losses)
        assert out.dtype == dtype
        rtol = 1e-2 if dtype == torch.float32 else 1e-6
        assert_matches(out, expected, rtol, f"{name} {dtype} scale={scale:g} K={k} P={p} "
                                            f"seed={seed} step={step}")


@st.composite
def cases(draw: st.DrawFn, name: str) -> tuple[int, int, int, float, torch.dtype, bool]:
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    k = draw(st.integers(build_balancer(name, 5).min_tasks, 5))
    # Full-rank rows (P ≥ K; float32 P ≥ K + 2). On a singular Gramian the pseudo-inverse
    # and active-set methods' rank decisions follow rounding at every scale, scale 1 included
    # (a conditioning matter, not a range one: tests/unit/balancers/test_solvers.py).
    p = draw(st.integers(k + 2, k + 8) if dtype == torch.float32 else st.integers(k, k + 8))
    scale = 10.0 ** draw(st.integers(-30, 30))
    return k, p, draw(st.integers(0, 2**20)), scale, dtype, draw(st.booleans())


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_float64_answer_across_scales(name: str, data: st.DataObject) -> None:
    k, p, seed, scale, dtype, conflict = data.draw(cases(name))
    check_scale(name, k, p, seed, scale, dtype, conflict)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("scale", [1e-30, 1e20, 1e30])
@pytest.mark.parametrize("name", NAMES)
def test_extreme_scales_regression(name: str, scale: float, dtype: torch.dtype) -> None:
    # The reported reproductions: fp32 rows of norm > 1.8e19 raised NonFiniteGradientError;
    # 1e-30 rows gave zero updates or wrong directions; MoCo/MoDo raised IndexError.
    check_scale(name, max(3, build_balancer(name, 5).min_tasks), 6, 0, scale, dtype)


@pytest.mark.parametrize("scale", [1e-150, 1e150])
@pytest.mark.parametrize("name", NAMES)
def test_float64_beyond_the_float32_range(name: str, scale: float) -> None:
    # The documented float64 range: ‖gₖ‖² stays a normal float64 down to 1e-300.
    check_scale(name, max(3, build_balancer(name, 5).min_tasks), 6, 1, scale, torch.float64)


@pytest.mark.parametrize("norm", [1.7e9, 1e12, 1e30])
def test_moco_projection_does_not_raise_on_large_rows(norm: float) -> None:
    g = rows(3, 3, 8, True)
    g = g / g.norm(dim=1, keepdim=True) * norm
    b = MoCo()
    for _ in range(3):
        out = b(g)
        assert bool(torch.isfinite(out).all())
    lam = b.state_dict()["_lambda"]
    assert float(lam.min()) >= 0.0 and abs(float(lam.sum()) - 1.0) < 1e-12


def test_finite_rows_whose_gramian_overflows_float64_are_not_called_nonfinite() -> None:
    g = rows(6, 3, 4, True) * 1e160
    with pytest.raises(ValueError, match="finite but their squared norms overflow"):
        UPGrad()(g)
    g[0, 0] = float("inf")
    with pytest.raises(gradbalance.NonFiniteGradientError):
        UPGrad()(g)


def test_mixed_row_scales_float64() -> None:
    # Rows 1e-30 … 1e30 apart in one matrix: the weighted methods see G / max diag, and the
    # answer is the weight rule's own on the plain Gramian (float64 holds 1e±60).
    g = rows(5, 4, 9, True) * torch.tensor([[1e-30], [1.0], [1e15], [1e30]],
                                             dtype=torch.float64)
    for name in NAMES:
        b = build_balancer(name, 4, 0)
        if not b.from_gramian or b.homogeneous_degree is None:
            continue
        expected = Reference(build_balancer(name, 4, 0), torch.float64)(g, losses_for(0, 4))
        assert_matches(b(g, losses_for(0, 4)), expected, 1e-6, f"{name} mixed")


# -- the Gramian and the buffer -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1.0, 1e20, 1e30])
def test_compute_gramian_is_exact_to_rounding(scale: float, dtype: torch.dtype) -> None:
    g = (rows(1, 4, 33, True) * scale).to(dtype)
    g64 = g.double()
    expected = g64 @ g64.T
    tol = {torch.float64: 1e-15, torch.float32: 1e-6, torch.bfloat16: 1e-6}[dtype]
    for block in (7, 1 << 20):
        gram = compute_gramian(g, block=block)
        assert float((gram - expected).abs().max()) <= tol * float(expected.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_scaled_and_plain_products_agree_bit_for_bit(dtype: torch.dtype) -> None:
    # On the CPU a block whose rows need no scaling skips the scaled copy; a power of two
    # changes no rounding, so both routes give the same Gramian.
    g = rows(7, 5, 40, True).to(dtype)
    unit, scale = unit_rows(g)
    scaled = (unit @ unit.T).double() * (scale[:, None] * scale[None, :])
    assert torch.equal(compute_gramian(g), scaled)


@pytest.mark.parametrize("scale", [1e-30, 1.0, 1e30])
@pytest.mark.parametrize(("n", "i", "o"), [(4, 64, 64), (64, 3, 2)])  # activation / row route
def test_linear_gramian_is_exact_to_rounding(scale: float, n: int, i: int, o: int) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(n, i, generator=gen, dtype=torch.float64) * math.sqrt(scale)
    d = torch.randn(3, n, o, generator=gen, dtype=torch.float64) * math.sqrt(scale)
    d[1] *= 1e3  # tasks of different scales
    x32, d32 = x.float(), d.float()
    x64, d64 = x32.double(), d32.double()
    blocks = torch.stack([(d64[k].T @ x64).reshape(-1) for k in range(3)])
    bias = d64.sum(dim=1)
    expected = blocks @ blocks.T + bias @ bias.T
    gram = linear_gramian(x32, d32, True, True)
    assert float((gram - expected).abs().max()) <= 1e-5 * float(expected.abs().max())


@pytest.mark.parametrize("scale", [1e-150, 1e-30, 1.0, 1e30, 1e150])
def test_cosine_matrix_keeps_tiny_and_huge_rows(scale: float) -> None:
    g = rows(4, 3, 5, True)
    expected = cosine_matrix(g @ g.T)
    torch.testing.assert_close(cosine_matrix((g @ g.T) * scale**2), expected)
    assert float(expected.abs().max()) <= 1.0


def _buffer_step(mode: str, scale: float, balancer: Balancer, dtype: torch.dtype,
                 ) -> tuple[list[Tensor], Any]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4)).to(dtype)
    heads = nn.ModuleList(nn.Linear(4, 1) for _ in range(3)).to(dtype)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1)).to(dtype)
    buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()), mode=mode,
                         modules=trunk if mode == "gramian" else None)
    feats = trunk(x)
    losses = torch.stack([h(feats).square().mean() * (k + 1) for k, h in enumerate(heads)])
    buf.backward(losses * scale, features=feats if mode == "features" else None)
    stats = buf.apply_(balancer)
    return [p.grad.double().clone() for p in trunk.parameters()], stats  # type: ignore[union-attr]


@pytest.mark.parametrize("mode", ["matrix", "gramian", "features"])
@pytest.mark.parametrize("scale", [1e-30, 1e20, 1e30])
@pytest.mark.parametrize("make", [Sum, UPGrad, MGDA], ids=["sum", "upgrad", "mgda"])
def test_buffer_finite_decision_at_extreme_scales(mode: str, scale: float,
                                                  make: Callable[[], Balancer]) -> None:
    # float32 task gradients of norm ~scale: no found_inf, and the step is the float64 step
    # at scale 1 times the scale (the balancers are homogeneous).
    grads, stats = _buffer_step(mode, scale, make(), torch.float32)
    assert not stats.found_inf
    expected, _ = _buffer_step(mode, 1.0, make(), torch.float64)
    flat = torch.cat([t.reshape(-1) for t in grads])
    ref = torch.cat([t.reshape(-1) for t in expected]) * scale
    assert_matches(flat, ref, 1e-3, f"{mode} scale={scale:g}")
