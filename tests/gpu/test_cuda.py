"""The balanced step on a CUDA device (docs/performance.md, "GPU check").

Five checks: a forced overflow under fp16 autocast and ``GradScaler`` skips the step and
moves nothing (docs/loop.md, "Mixed precision"); ``passes="auto"`` decides on the device and
gives the update of ``"loop"`` and ``"batched"``; ``gramian`` mode, each per-layer route forced
and as chosen, gives ``matrix`` mode's Gramian and update; bf16 and fp16 autocast steps stay
near the fp32 step; and a float64 step on the device equals the same step on the CPU.

Without CUDA every test skips; ``GRADBALANCE_GPU_TESTS_DEVICE=cpu`` runs them on the CPU, where
the comparisons with the CPU are trivial but the logic of each check runs (``conftest.py``).
The references are independent routes (``matrix`` mode's ``[K, P]`` rows, the loop of K
``autograd.grad`` calls, the float32 forward, the CPU), and the tolerances come from the
problem's sizes and the dtype's unit roundoff, never from a run of the code under test.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor

from gradbalance import TaskAutoClip, TaskGradBuffer, taskgrads
from gradbalance.balancers import BALANCERS, Balancer, Sum, UPGrad
from gradbalance.gramian import compute_gramian
from gradbalance.modes._gramian import GramianMode
from gradbalance.weighting import WEIGHTINGS
from gradbalance_lab.models import MultiTaskModel
from support.balancers import build_balancer
from support.helpers import build, losses_of
from support.loop_state import assert_same_state

K = 3
ROUTES = [None, "rows", "activations"]
ROUTE_IDS = ["chosen", "rows", "activations"]


def _on(device: torch.device, kind: str, dtype: torch.dtype = torch.float32
        ) -> tuple[MultiTaskModel, Tensor, Tensor]:
    """The ``support.helpers.build`` model and batch (made on the CPU, seeded), on ``device``.

    The CNN sees 12×12 crops of its 28×28 images: its first convolution's rows (batch ×
    positions) fall from 6272 to 1152, so the activations route forced on it (``N²``
    products per task pair) stays cheap where these tests run on a CPU.
    """
    model, x, y = build(kind, num_tasks=K, dtype=dtype)
    if kind == "cnn":
        x = x[..., :12, :12].contiguous()
    return model.to(device), x.to(device), y.to(device)


def _buffer(model: MultiTaskModel, mode: str = "matrix", **kwargs: Any) -> TaskGradBuffer:
    if mode in ("gramian", "auto"):
        kwargs["modules"] = model.trunk
    return TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode=mode,
                          **kwargs)


def _grads(model: MultiTaskModel) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _roundoff(model: MultiTaskModel, x: Tensor, dtype: torch.dtype) -> float:
    """``n·u``: the worst-case relative error of a sum of ``n`` rounded products (Higham,
    *Accuracy and Stability of Numerical Algorithms*, 2002, §3.1), for the longest chain of
    sums in a step: the ``P`` products of a Gramian entry, plus at most ``x.numel()`` in any
    one sum of the backward (a weight gradient sums over the batch's rows, an input gradient
    over a layer's width; both within the input's numbers on these trunks)."""
    n = sum(p.numel() for p in model.shared_parameters()) + x.numel()
    return n * torch.finfo(dtype).eps / 2


def _condition(gramian: Tensor) -> float:
    """``λ_max / λ_min`` of the task Gramian: how much a balancer's weights, the solution of
    a problem in the Gramian, may amplify a relative perturbation of it."""
    eig = torch.linalg.eigvalsh(gramian.detach().double().cpu())
    return float(eig[-1] / eig[0].clamp_min(eig[-1] * 1e-12))


def _assert_close(actual: list[Tensor | None], expected: list[Tensor | None],
                  rtol: float) -> None:
    """Each tensor within ``rtol`` of its reference, entries near zero within ``rtol`` times
    the largest reference entry (a sum that cancels keeps only absolute precision)."""
    assert [a is None for a in actual] == [e is None for e in expected]
    scale = max(float(e.abs().max()) for e in expected if e is not None and e.numel())
    for a, e in zip(actual, expected):
        if a is not None and e is not None:
            torch.testing.assert_close(a.cpu(), e.cpu(), rtol=rtol, atol=rtol * scale)


# -- (a) GradScaler and fp16 autocast: a forced overflow skips the step ---------------------

def _scaler(device: torch.device) -> torch.amp.GradScaler:
    # 2**10, not the default 2**16: the healthy steps' fp16 gradients stay below fp16's
    # largest number (65504), so only the forced overflow makes the scaler skip.
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**10)
    assert scaler.is_enabled()
    return scaler


@pytest.mark.parametrize("mode", ["matrix", "gramian"])
@pytest.mark.parametrize("spec", ["pcgrad", "gradvac"])
def test_fp16_overflow_skips_the_step_and_moves_nothing(device: torch.device, spec: str,
                                                        mode: str) -> None:
    model, x, y = _on(device, "mlp")
    balancer = build_balancer(spec, K)  # PCGrad's orders, GradVac's targets: state to keep
    clipper = TaskAutoClip(percentile=50, history_size=8)
    scaler = _scaler(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    buf = _buffer(model, mode)

    def step(factor: float) -> bool:
        with torch.autocast(device.type, dtype=torch.float16):
            losses = losses_of(model, x, y).float()
        losses = losses * torch.tensor([1.0, factor, 1.0], device=device)
        buf.backward(losses, scaler=scaler)
        return bool(buf.apply_(balancer, scaler=scaler, clip=clipper).found_inf)

    def finish() -> bool:
        """The optimizer step through the scaler; whether the scaler skipped it."""
        scale = scaler.get_scale()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        return scaler.get_scale() < scale

    for _ in range(2):  # healthy steps: Adam's moments, the balancer's and clipper's state
        assert not step(1.0)
        assert not finish()
    saved = [copy.deepcopy(o.state_dict()) for o in (balancer, clipper, opt)]
    params = [p.detach().clone() for p in model.parameters()]
    scale = scaler.get_scale()

    assert step(1e38)  # 1e38 times the scale overflows float32: task 1's gradient is inf
    for p in model.parameters():  # every .grad the step wrote is non-finite, so all skip
        assert p.grad is not None and not bool(torch.isfinite(p.grad).all())
    assert finish()
    assert scaler.get_scale() == scale * scaler.get_backoff_factor()
    for p, before in zip(model.parameters(), params):
        assert torch.equal(p.detach(), before)
    for obj, state in zip((balancer, clipper, opt), saved):
        assert_same_state(obj.state_dict(), state)

    assert not step(1.0)  # the next healthy step is taken
    assert not finish()
    assert any(not torch.equal(p.detach(), q) for p, q in zip(model.parameters(), params))


# -- (b) passes="auto" on the device ------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_auto_passes_decide_on_the_device_and_equal_loop_and_batched(
        device: torch.device, kind: str, dtype: torch.dtype) -> None:
    rows, grads, states = {}, {}, {}
    for passes in ("loop", "batched", "auto"):
        model, x, y = _on(device, kind, dtype)
        buf = _buffer(model, passes=passes)
        buf.backward(losses_of(model, x, y))
        assert buf.matrix is not None
        rows[passes] = buf.matrix.clone()
        buf.apply_(UPGrad())
        grads[passes], states[passes] = _grads(model), buf.state_dict()
    preference = taskgrads.AUTO_PREFERENCE.get(device.type)
    if preference is None:  # measured on the first step, kept for a resumed run
        assert states["auto"]["passes"] in ("loop", "batched")
    else:  # the device's measured preference, taken without timing
        assert "passes" not in states["auto"]
    tol = _roundoff(model, x, dtype)
    for passes in ("batched", "auto"):
        _assert_close([rows[passes]], [rows["loop"]], tol)
        _assert_close(grads[passes], grads["loop"],
                      tol * _condition(compute_gramian(rows["loop"])))


# -- (c) gramian mode against matrix mode ---------------------------------------------------

def _gramian_step(device: torch.device, kind: str, mode: str, force: str | None,
                  dtype: torch.dtype, balancer: Balancer
                  ) -> tuple[Tensor, list[Tensor | None], TaskGradBuffer, float]:
    """One step over two micro-batches (5 + 3 rows): the Gramian before the combine, every
    ``.grad`` after it, the buffer and the problem's roundoff bound."""
    model, x, y = _on(device, kind, dtype)
    buf = _buffer(model, mode)
    engine = buf._engine
    if mode == "gramian":
        assert isinstance(engine, GramianMode)
        engine.recorder.force = force
    for part in (slice(0, 5), slice(5, 8)):
        rows = x[part].shape[0]
        buf.backward(losses_of(model, x[part], y[part]) * (rows / x.shape[0]))
    if isinstance(engine, GramianMode):
        gram = engine.recorder.gramian(K, device)
    else:
        assert buf.matrix is not None
        gram = compute_gramian(buf.matrix)
    buf.apply_(balancer)
    return gram, _grads(model), buf, _roundoff(model, x, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("force", ROUTES, ids=ROUTE_IDS)
@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
def test_gramian_mode_equals_matrix_mode(device: torch.device, kind: str, force: str | None,
                                         dtype: torch.dtype) -> None:
    gram_m, grads_m, _, tol = _gramian_step(device, kind, "matrix", None, dtype, UPGrad())
    gram_g, grads_g, buf, _ = _gramian_step(device, kind, "gramian", force, dtype, UPGrad())
    # A Gramian entry sums products bounded by the largest diagonal entry (Cauchy-Schwarz).
    torch.testing.assert_close(gram_g.cpu(), gram_m.cpu(), rtol=tol,
                               atol=tol * float(gram_m.diagonal().max()))
    _assert_close(grads_g, grads_m, tol * _condition(gram_m))
    routes = buf.layer_routes
    assert routes
    if force is not None:
        assert set(routes.values()) == {force}
    # Fixed weights (Sum): the write-back alone, no solver between the two modes.
    _, sum_m, _, _ = _gramian_step(device, kind, "matrix", None, dtype, Sum())
    _, sum_g, _, _ = _gramian_step(device, kind, "gramian", force, dtype, Sum())
    _assert_close(sum_g, sum_m, tol)


# -- (d) bf16 and fp16 autocast against the fp32 step --------------------------------------

#: Matrix products of the ``mlp`` trunk and a head: each 16-bit product rounds its input,
#: weight and output in the forward and the output gradient, input gradient and weight
#: gradient in the backward (six roundings of relative size u).
_PRODUCTS = 4


def _autocast_update(device: torch.device, spec: str, dtype: torch.dtype | None) -> Tensor:
    """Every parameter's unscaled gradient after one balanced step, flattened (``dtype``
    None: float32 without autocast or scaler)."""
    model, x, y = _on(device, "mlp")
    weighting = None
    if spec == "gradnorm":
        weighting = WEIGHTINGS["gradnorm"](K, model.trunk, device=device)
        balancer: Balancer = Sum()
    else:
        balancer = build_balancer(spec, K)
    scaler = None if dtype is None else _scaler(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    buf = _buffer(model)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        losses = losses_of(model, x, y).float()
    if weighting is not None:
        losses = weighting(losses, scaler=scaler)
    buf.backward(losses, scaler=scaler)
    assert not buf.apply_(balancer, scaler=scaler).found_inf
    if scaler is not None:
        scaler.unscale_(opt)
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec", ["pcgrad", "mgda", "upgrad", "gradnorm"])
def test_16bit_autocast_step_is_finite_and_near_fp32(device: torch.device, spec: str,
                                                    dtype: torch.dtype) -> None:
    ref = _autocast_update(device, spec, None).double()
    amp = _autocast_update(device, spec, dtype).double()
    assert bool(torch.isfinite(amp).all())
    # First order, each rounding perturbs the gradient by at most u in relative norm:
    # 6·u per product, 24·u in all (bf16: u = 2⁻⁸, 0.094; fp16: u = 2⁻¹¹, 0.012). The
    # balancers' weights are smooth in G away from their switching points (PCGrad's signs,
    # MGDA's and UPGrad's active sets), which these seeded problems are not near. A scaled-G
    # bug is off by the loss scale (2¹⁰), a task left out by its whole gradient.
    bound = 6 * _PRODUCTS * torch.finfo(dtype).eps / 2
    error = float((amp - ref).norm() / ref.norm())
    assert error < bound, f"relative error {error:.3g} > {bound:.3g}"


# -- (e) the same float64 step on the device and on the CPU ---------------------------------

@pytest.mark.parametrize("name", sorted(BALANCERS))
def test_device_step_equals_cpu_step_in_float64(device: torch.device, name: str) -> None:
    grads = []
    for where in (torch.device("cpu"), device):
        model, x, y = _on(where, "mlp", torch.float64)
        buf = _buffer(model)
        buf.backward(losses_of(model, x, y))
        buf.apply_(build_balancer(name, K))  # a seeded CPU generator: the same draws
        grads.append(_grads(model))
    _assert_close(grads[1], grads[0], 1e-10)
