"""``gramian`` mode's per-layer routes: each ``nn.Linear`` takes the per-task rows or the
activation Gramian; every route gives ``matrix`` mode's Gramian and ``.grad``.

The reference is ``matrix`` mode on an identical model (an independent route: autograd's
``[K, P]`` rows). Routes are forced through ``recorder.force``; the cost model's choice is
checked against crossovers derived by hand from its closed form (docs/performance.md).
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gradbalance import TaskClip, TaskGradBuffer
from gradbalance.balancers import UPGrad
from gradbalance.gramian import compute_gramian
from gradbalance.modes._gramian import GramianMode
from gradbalance_lab.models import MultiTaskModel, make_heads, regression_losses, transformer_trunk

K = 3
ROUTES = [None, "rows", "activations"]


class _Unreached(nn.Module):
    """A linear layer the forward never calls, next to two it does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.unused, self.b = nn.Linear(6, 7), nn.Linear(7, 7), nn.Linear(7, 4)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.b(torch.tanh(self.a(x)))
        return out


def _model(kind: str, dtype: torch.dtype) -> tuple[MultiTaskModel, Tensor, Tensor]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if kind == "mlp":
        trunk: nn.Module = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10),
                                         nn.Tanh(), nn.Linear(10, 4))
        x, width = torch.randn(8, 6, generator=gen), 4
    elif kind == "conv":  # a strided, padded Conv2d under a linear layer
        trunk = nn.Sequential(nn.Conv2d(1, 3, 3, stride=2, padding=1), nn.ReLU(),
                              nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(12, 4))
        x, width = torch.randn(8, 1, 6, 6, generator=gen), 4
    elif kind == "conv1d":  # dilated and strided Conv1d layers
        trunk = nn.Sequential(nn.Conv1d(2, 4, 3, padding=2, dilation=2), nn.Tanh(),
                              nn.Conv1d(4, 4, 2, stride=2), nn.Flatten(), nn.Linear(16, 4))
        x, width = torch.randn(8, 2, 8, generator=gen), 4
    elif kind == "transformer":  # attention and norms: rows; the feed-forward: either
        trunk, width = transformer_trunk(8, 1, 2), 8
        x = torch.randn(8, 5, 8, generator=gen)
    else:
        trunk, width = _Unreached(), 4
        x = torch.randn(8, 6, generator=gen)
    model = MultiTaskModel(trunk, make_heads(width, K)).to(dtype)
    y = torch.randn(8, K, generator=gen)
    return model, x.to(dtype), y.to(dtype)


def _step(model: MultiTaskModel, x: Tensor, y: Tensor, mode: str, force: Any = None,
          sizes: tuple[int, ...] = (5, 3), scaler: Any = None,
          clip: Any = None) -> tuple[Tensor, list[Tensor | None], TaskGradBuffer]:
    """One step over micro-batches of ``sizes`` rows; the (scaled) Gramian before the
    combine and every parameter's ``.grad`` after it."""
    kwargs = {"modules": model.trunk} if mode == "gramian" else {}
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                         mode=mode, **kwargs)  # type: ignore[arg-type]
    if mode == "gramian":
        _engine(buf).recorder.force = force
    start = 0
    for size in sizes:
        part = slice(start, start + size)
        losses = regression_losses(model(x[part]), y[part]) * (size / sum(sizes))
        buf.backward(losses, scaler=scaler)
        start += size
    if mode == "gramian":
        gram = _engine(buf).recorder.gramian(K, x.device)
    else:
        assert buf.matrix is not None
        gram = compute_gramian(buf.matrix)
    buf.apply_(UPGrad(), scaler=scaler, clip=clip)
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    return gram, grads, buf


def _engine(buf: TaskGradBuffer) -> GramianMode:
    engine = buf._engine
    assert isinstance(engine, GramianMode)
    return engine


def _assert_same(actual: list[Tensor | None], expected: list[Tensor | None],
                 rtol: float) -> None:
    """Equal to ``rtol``, entries near zero to ``rtol`` times the largest gradient entry (a
    parameter whose gradient cancels to rounding level has no relative precision)."""
    assert [a is None for a in actual] == [e is None for e in expected]
    scale = max((float(e.abs().max()) for e in expected if e is not None and e.numel()),
                default=0.0)
    for a, e in zip(actual, expected):
        if a is not None and e is not None:
            torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * scale)


def _compare(kind: str, force: Any, dtype: torch.dtype, rtol: float, **kwargs: Any
             ) -> TaskGradBuffer:
    results = []
    for mode in ("matrix", "gramian"):
        model, x, y = _model(kind, dtype)
        results.append(_step(model, x, y, mode, force, **kwargs))
    (gram_m, grads_m, _), (gram_g, grads_g, buf) = results
    torch.testing.assert_close(gram_g, gram_m, rtol=rtol, atol=rtol * float(gram_m.abs().max()))
    _assert_same(grads_g, grads_m, rtol)
    return buf


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float64, 1e-10), (torch.float32, 1e-5)],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("force", ROUTES, ids=["model", "rows", "activations"])
@pytest.mark.parametrize("kind", ["mlp", "conv", "conv1d", "transformer", "unreached"])
def test_every_route_gives_matrix_modes_gramian_and_grad(kind: str, force: Any,
                                                         dtype: torch.dtype, rtol: float) -> None:
    buf = _compare(kind, force, dtype, rtol)
    routes = buf.layer_routes
    assert routes is not None and routes
    if force is not None:
        assert set(routes.values()) == {force}


@pytest.mark.parametrize("force", ROUTES, ids=["model", "rows", "activations"])
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_every_route_under_a_grad_scaler_with_task_clipping(kind: str, force: Any) -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    assert scaler.is_enabled()
    results = []
    for mode in ("matrix", "gramian"):
        model, x, y = _model(kind, torch.float32)
        results.append(_step(model, x, y, mode, force, scaler=scaler, clip=TaskClip(0.05)))
    _assert_same(results[1][1], results[0][1], 1e-5)


def test_an_unreached_layer_keeps_grad_none_on_every_route() -> None:
    for force in ROUTES:
        model, x, y = _model("unreached", torch.float64)
        _step(model, x, y, "gramian", force)
        trunk = model.trunk
        assert isinstance(trunk, _Unreached)
        assert trunk.unused.weight.grad is None and trunk.unused.bias.grad is None
        assert trunk.a.weight.grad is not None


class _Positions(nn.Module):
    """``Conv1d(64, 64, 1, bias=False)`` over ``rows`` positions of one sample, the positions
    then averaged: the linear form of ``Linear(64, 64, bias=False)`` over ``rows`` rows."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(64, 64, 1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.conv(x.T.unsqueeze(0)).squeeze(0).T
        return out


def _single_layer(k: int, rows: int, sizes: tuple[int, ...] | None = None, conv: bool = False
                  ) -> tuple[list[str], TaskGradBuffer, MultiTaskModel]:
    """``Linear(64, 64, bias=False)`` (or the 1x1 convolution of the same linear form)
    shared, K linear heads, float64; the layer's route after each micro-batch."""
    torch.manual_seed(0)
    layer: nn.Module = _Positions() if conv else nn.Sequential(nn.Linear(64, 64, bias=False))
    model = MultiTaskModel(layer, make_heads(64, k)).double()
    x = torch.randn(rows, 64, dtype=torch.float64)
    y = torch.randn(rows, k, dtype=torch.float64)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="gramian",
                         modules=model.trunk)
    seen, start = [], 0
    for size in sizes or (rows,):
        buf.backward(regression_losses(model(x[start:start + size]), y[start:start + size]))
        start += size
        routes = buf.layer_routes
        assert routes is not None
        seen.append(routes["conv" if conv else "0"])
    buf.apply_(UPGrad())
    return seen, buf, model


@pytest.mark.parametrize(("k", "rows", "route"), [
    # K = 8: time decides. act(N) = 12352 N² + 107520 N, rows(N) = 65536 N + 10813440
    # (flops plus 64 per float64 moved): equal at N = 27.9
    (8, 27, "activations"), (8, 28, "rows"),
    # K = 2: memory decides. act holds 3 N² + 192 N numbers, rows K·P = 8192: N ≤ 29 (time
    # alone would keep the activations up to N = 47)
    (2, 29, "activations"), (2, 30, "rows")])
@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv1d"])
def test_the_choice_flips_at_the_hand_derived_crossover(k: int, rows: int, route: str,
                                                        conv: bool) -> None:
    assert _single_layer(k, rows, conv=conv)[0] == [route]


def test_a_layer_moves_to_rows_when_micro_batches_make_them_cheaper() -> None:
    # K = 8, 16 rows per micro-batch: N = 16 and 32 keep the activations (act 16.1M against
    # rows 19.2M flop equivalents at N = 32, m = 2); at N = 48, m = 3, act 33.6M > rows 26.5M
    seen, _, model = _single_layer(8, 48, (16, 16, 16))
    assert seen == ["activations", "activations", "rows"]
    torch.manual_seed(0)
    reference = MultiTaskModel(nn.Sequential(nn.Linear(64, 64, bias=False)),
                               make_heads(64, 8)).double()
    x = torch.randn(48, 64, dtype=torch.float64)
    y = torch.randn(48, 8, dtype=torch.float64)
    buf = TaskGradBuffer(reference.shared_parameters(), reference.head_parameters())
    for start in (0, 16, 32):
        buf.backward(regression_losses(reference(x[start:start + 16]), y[start:start + 16]))
    buf.apply_(UPGrad())
    _assert_same([p.grad for p in model.parameters()],
                 [p.grad for p in reference.parameters()], 1e-10)


@settings(max_examples=40, deadline=None)
@given(i=st.integers(1, 9), o=st.integers(1, 9), n=st.integers(1, 8), k=st.integers(1, 4),
       bias=st.booleans(), micro=st.integers(1, 2), force=st.sampled_from(ROUTES))
def test_random_layers_every_route_equals_matrix_mode(i: int, o: int, n: int, k: int,
                                                      bias: bool, micro: int, force: Any) -> None:
    grams, grads = [], []
    for mode in ("matrix", "gramian"):
        torch.manual_seed(0)
        trunk = nn.Sequential(nn.Linear(i, o, bias=bias), nn.Tanh(), nn.Linear(o, 3))
        model = MultiTaskModel(trunk, make_heads(3, k)).double()
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(n * micro, i, generator=gen, dtype=torch.float64)
        y = torch.randn(n * micro, k, generator=gen, dtype=torch.float64)
        kwargs = {"modules": trunk} if mode == "gramian" else {}
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                             mode=mode, **kwargs)  # type: ignore[arg-type]
        if mode == "gramian":
            _engine(buf).recorder.force = force
        for m in range(micro):
            part = slice(m * n, (m + 1) * n)
            buf.backward(regression_losses(model(x[part]), y[part]) / micro)
        grams.append(_engine(buf).recorder.gramian(k, x.device) if mode == "gramian"
                     else compute_gramian(buf.matrix))  # type: ignore[arg-type]
        buf.apply_(UPGrad())
        grads.append([p.grad for p in model.parameters()])
    torch.testing.assert_close(grams[1], grams[0], rtol=1e-10,
                               atol=1e-10 * float(grams[0].abs().max()) + 1e-300)
    _assert_same(grads[1], grads[0], 1e-10)


def test_resume_is_bit_identical_across_route_changes() -> None:
    # micro-batches of 4 and 24 rows: the mlp's layers change route between steps
    schedule = [(4,), (4, 4), (24,), (4,), (12, 12), (4,)]

    def run(model: MultiTaskModel, buf: TaskGradBuffer, opt: Any, steps: list[Any],
            x: Tensor, y: Tensor) -> list[dict[str, str] | None]:
        seen = []
        for sizes in steps:
            start = 0
            for size in sizes:
                buf.backward(regression_losses(model(x[start:start + size]), y[start:start + size]))
                start += size
            buf.apply_(UPGrad())
            seen.append(buf.layer_routes)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return seen

    def fresh() -> tuple[MultiTaskModel, TaskGradBuffer, Any]:
        torch.manual_seed(0)
        model = MultiTaskModel(nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48)),
                               make_heads(48, K)).double()
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                             mode="gramian", modules=model.trunk)
        return model, buf, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(24, 16, generator=gen, dtype=torch.float64)
    y = torch.randn(24, K, generator=gen, dtype=torch.float64)
    model, buf, opt = fresh()
    run(model, buf, opt, schedule[:3], x, y)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "buf": buf.state_dict()},
               saved)
    straight = run(model, buf, opt, schedule[3:], x, y)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    model2, buf2, opt2 = fresh()
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["opt"])
    buf2.load_state_dict(state["buf"])
    resumed = run(model2, buf2, opt2, schedule[3:], x, y)
    assert resumed == straight
    assert len({tuple(r.values()) for r in straight if r}) > 1  # the routes did change
    for a, b in zip(model2.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_bad_forced_route_raises_naming_it() -> None:
    model, x, y = _model("mlp", torch.float64)
    with pytest.raises(ValueError, match="Invalid force: 'ghost'"):
        _step(model, x, y, "gramian", "ghost")


@settings(max_examples=30, deadline=None)
@given(c_in=st.integers(1, 3), c_out=st.integers(1, 3), kernel=st.integers(1, 3),
       stride=st.integers(1, 2), padding=st.integers(0, 1), size=st.integers(3, 5),
       batch=st.integers(1, 3), k=st.integers(1, 3), force=st.sampled_from(ROUTES))
def test_random_convolutions_every_route_equals_matrix_mode(
        c_in: int, c_out: int, kernel: int, stride: int, padding: int, size: int, batch: int,
        k: int, force: Any) -> None:
    grads = []
    for mode in ("matrix", "gramian"):
        torch.manual_seed(0)
        trunk = nn.Sequential(nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=padding),
                              nn.Tanh(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        model = MultiTaskModel(trunk, make_heads(c_out, k)).double()
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(batch, c_in, size, size, generator=gen, dtype=torch.float64)
        y = torch.randn(batch, k, generator=gen, dtype=torch.float64)
        kwargs = {"modules": trunk} if mode == "gramian" else {}
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                             mode=mode, **kwargs)  # type: ignore[arg-type]
        if mode == "gramian":
            _engine(buf).recorder.force = force
        buf.backward(regression_losses(model(x), y))
        buf.apply_(UPGrad())
        grads.append([p.grad for p in model.parameters()])
    _assert_same(grads[1], grads[0], 1e-10)


def test_a_layer_bound_for_the_rows_keeps_no_tensor_of_its_forward() -> None:
    # Linear(64, 64, bias=False), K = 8, float64: 28 rows take the rows, 27 the activations
    # (hand-derived above); from the second step on, K is known at the forward (before it
    # K = 2 stands in, where 28 rows take the activations: N <= 29)
    for rows, kept in ((28, False), (27, True)):
        torch.manual_seed(0)
        model = MultiTaskModel(nn.Sequential(nn.Linear(64, 64, bias=False)),
                               make_heads(64, 8)).double()
        x, y = torch.randn(rows, 64, dtype=torch.float64), torch.randn(rows, 8, dtype=torch.float64)
        buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="gramian",
                             modules=model.trunk)
        recorder = _engine(buf).recorder
        for step in range(2):
            losses = regression_losses(model(x), y)
            call = recorder.linear[0].calls[0]
            assert (call.output is not None) == (kept or step == 0)
            buf.backward(losses)
            buf.apply_(UPGrad())



def test_before_the_first_step_k_2_stands_in_and_k_is_saved() -> None:
    # Linear(64, 64, bias=False), float64, 30 rows: K = 2 takes the rows (memory: 8460 > 8192,
    # above); K = 4 the activations (act 3136 N² + 57856 N = 4.56M against rows 32768 N +
    # 5341184 = 6.32M; memory 5 N² + 320 N = 14100 <= K·P = 16384). The first step's forward
    # keeps nothing, so that step takes the rows; the next ones know K = 4, also after a load
    def run(buf: TaskGradBuffer, model: MultiTaskModel, steps: int) -> list[str]:
        seen = []
        for _ in range(steps):
            buf.backward(regression_losses(model(x), y))
            buf.apply_(UPGrad())
            routes = buf.layer_routes
            assert routes is not None
            seen.append(routes["0"])
        return seen

    def fresh() -> tuple[MultiTaskModel, TaskGradBuffer]:
        torch.manual_seed(0)
        model = MultiTaskModel(nn.Sequential(nn.Linear(64, 64, bias=False)),
                               make_heads(64, 4)).double()
        return model, TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                                     mode="gramian", modules=model.trunk)

    x, y = torch.randn(30, 64, dtype=torch.float64), torch.randn(30, 4, dtype=torch.float64)
    model, buf = fresh()
    assert run(buf, model, 3) == ["rows", "activations", "activations"]
    state = buf.state_dict()
    assert state["gramian_tasks"] == 4
    model2, buf2 = fresh()
    with pytest.raises(ValueError, match=r"state_dict\['gramian_tasks'\]: 0"):
        buf2.load_state_dict({**state, "gramian_tasks": 0})
    assert buf2.state_dict() == fresh()[1].state_dict()  # nothing moved
    buf2.load_state_dict(state)
    assert run(buf2, model2, 1) == ["activations"]
