"""``auto`` mode: matrix mode's update whichever route runs; the cost model and its decisions.

The reference is ``matrix`` mode on an identical model (an independent route: the ``[K, P]``
rows). The clock of the trials is replaced by one that charges each route a fixed time, so
every decision is deterministic; the cost model is checked against its closed-form flop counts
computed here.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskClip, TaskGradBuffer, TaskValueClip, stats_to_dict
from gradbalance.balancers import Balancer, UPGrad
from gradbalance.modes import ENGINES, MODES, _auto
from gradbalance.modes._auto import AutoMode, LinearShape, route_costs
from gradbalance_lab.models import MultiTaskModel, make_heads, regression_losses
from support.helpers import build, optimizer_step
from support.perf import make_balancer

#: micro-batch sizes per step: shape changes (16 rows, 8 + 8, 5 + 3, 12) and returns
SCHEDULE: list[tuple[int, ...]] = [(16,), (16,), (8, 8), (8, 8), (16,), (5, 3), (5, 3),
                                   (16,), (12,), (12,), (8, 8), (16,)]


class RouteClock:
    """A clock that advances by a fixed time per route at every reading."""

    def __init__(self, engine: AutoMode, seconds: dict[str, float]) -> None:
        self.engine, self.seconds, self.now = engine, seconds, 0.0

    def __call__(self) -> float:
        self.now += self.seconds[self.engine.route]
        return self.now


def _buffer(model: MultiTaskModel, mode: str, clock: dict[str, float] | None = None,
            **kwargs: Any) -> TaskGradBuffer:
    if mode == "auto":
        kwargs.setdefault("modules", model.trunk)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                         mode=mode, **kwargs)  # type: ignore[arg-type]
    if mode == "auto":
        engine = buf._engine
        assert isinstance(engine, AutoMode)
        engine.clock = RouteClock(engine, clock or {"matrix": 1.0, "gramian": 2.0})
    return buf


def _run(model: MultiTaskModel, x: Tensor, y: Tensor, buf: TaskGradBuffer, balancer: Balancer,
         schedule: Sequence[tuple[int, ...]], *, scaler: Any = None, clip: Any = None,
         opt: torch.optim.Optimizer | None = None) -> list[Any]:
    """SGD steps over ``schedule``; each micro-batch's losses weighted by its share."""
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.05)
    stats = []
    for sizes in schedule:
        total, start = sum(sizes), 0
        for size in sizes:
            part = slice(start, start + size)
            losses = regression_losses(model(x[part]), y[part]) * (size / total)
            buf.backward(losses, scaler=scaler)
            start += size
        stats.append(buf.apply_(balancer, scaler=scaler, clip=clip))
        optimizer_step(opt, scaler)
    return stats


def _params(model: nn.Module) -> list[Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _close(actual: list[Tensor], expected: list[Tensor], rtol: float = 1e-9) -> None:
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * float(e.abs().max()))


def _compare(kind: str, name: str, clock: dict[str, float], *, scaler: bool = False,
             clip_of: Callable[[], Any] | None = None, update_every: int = 1,
             dtype: torch.dtype = torch.float64) -> list[Any]:
    """Auto against matrix mode over SCHEDULE; returns auto's stats."""
    results = []
    for mode in ("matrix", "auto"):
        model, x, y = build(kind, batch=16, dtype=dtype)
        buf = _buffer(model, mode, clock, update_every=update_every)
        grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
        stats = _run(model, x, y, buf, make_balancer(name), SCHEDULE, scaler=grad_scaler,
                     clip=None if clip_of is None else clip_of())
        results.append((_params(model), stats))
    (ref, _), (params, stats) = results
    _close(params, ref, 1e-9 if dtype == torch.float64 else 1e-4)
    return stats


def test_auto_is_a_shipped_mode() -> None:
    assert "auto" in MODES and ENGINES["auto"] is AutoMode


@pytest.mark.parametrize("clock", [{"matrix": 1.0, "gramian": 2.0},
                                   {"matrix": 2.0, "gramian": 1.0}], ids=["matrix", "gramian"])
@pytest.mark.parametrize("name", ["upgrad", "mgda", "pcgrad", "nashmtl", "imtlg"])
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_auto_equals_matrix_mode(kind: str, name: str, clock: dict[str, float]) -> None:
    # mlp: two of its three layers gain (predicted ratio 0.70), the trials time both routes;
    # transformer: no layer gains (96 token rows per layer), the model decides matrix
    stats = _compare(kind, name, clock)
    routes = [s.route for s in stats]
    assert routes[0] == "matrix"  # the balancer is not known before the first apply_
    assert all(s.mode == "auto" for s in stats)
    assert ("gramian" in routes) == (kind == "mlp")


@pytest.mark.parametrize("kind", ["mlp"])
def test_auto_with_a_scaler_and_norm_clipping(kind: str) -> None:
    stats = _compare(kind, "upgrad", {"matrix": 2.0, "gramian": 1.0}, scaler=True,
                     clip_of=lambda: TaskClip(0.5), dtype=torch.float32)
    assert "gramian" in [s.route for s in stats]
    assert not any(s.found_inf for s in stats)


def test_auto_with_update_every() -> None:
    stats = _compare("mlp", "upgrad", {"matrix": 1.0, "gramian": 2.0}, update_every=3)
    assert [s.weights_reused for s in stats[:4]] == [False, True, True, False]
    assert stats[3].route == "gramian" and stats[1].route is None


@pytest.mark.parametrize(("name", "clip_of"), [("graddrop", None), ("trimmedmean", None),
                                               ("upgrad", lambda: TaskValueClip(0.1))])
def test_matrix_when_the_step_needs_the_rows(name: str, clip_of: Any) -> None:
    stats = _compare("mlp", name, {"matrix": 2.0, "gramian": 1.0}, clip_of=clip_of)
    assert {s.route for s in stats} == {"matrix"}


def test_matrix_without_modules_or_when_they_miss_parameters_or_are_compiled() -> None:
    model, x, y = build("mlp", batch=16, dtype=torch.float64)
    for modules in (None, model.trunk[0], torch.compile(model.trunk)):
        buf = _buffer(model, "auto", modules=modules)
        stats = _run(model, x, y, buf, UPGrad(), SCHEDULE[:4])
        assert {s.route for s in stats} == {"matrix"}


class _TiedTrunk(nn.Module):
    """A linear layer whose weight is also used outside its forward: gramian would miss it."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        out: Tensor = self.b(h) + h @ self.a.weight.T
        return out


class _InPlaceTrunk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.b(torch.relu_(self.a(x)))
        return out


@pytest.mark.parametrize("trunk_of", [_TiedTrunk, _InPlaceTrunk])
def test_matrix_where_the_gramian_route_would_be_wrong(trunk_of: Callable[[], nn.Module]) -> None:
    finals = []
    for mode in ("matrix", "auto"):
        torch.manual_seed(0)
        model = MultiTaskModel(trunk_of(), make_heads(6, 3)).double()
        x, y = torch.randn(16, 6, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
        buf = _buffer(model, mode, {"matrix": 2.0, "gramian": 1.0})
        stats = _run(model, x, y, buf, UPGrad(), SCHEDULE[:5])
        finals.append(_params(model))
    assert {s.route for s in stats} == {"matrix"}
    _close(finals[1], finals[0])


# -- the cost model ----------------------------------------------------------------------------

def _closed_form(n: int, i: int, o: int, k: int, other: int, micro: int,
                 byte: float) -> tuple[float, float]:
    """One linear layer (weight and bias shared) plus ``other`` numbers in other blocks:
    ``matrix`` pays the per-task rows, ``gramian`` the activations where they are faster
    and hold no more memory than the rows (docs/performance.md, the per-layer choice)."""
    big_n, p = micro * n, o * i + o
    shared = k * k * other + 2 * k * other + (3 * micro + 2) * k * other * byte
    rows = (2 * k * big_n * o * i + k * big_n * o + k * k * p + 2 * k * p
            + (3 * micro + 2) * k * p * byte)
    act = (big_n**2 * (i + k * k * o) + 2 * k * k * big_n**2 * byte + k * big_n * o + k * k * o
           + 2 * big_n * o * i + 2 * k * big_n * o + 3 * k * big_n * o * byte)
    act_memory = k * big_n * o + big_n * i + big_n**2 + k * big_n**2
    chosen = act if act < rows and act_memory <= k * p else rows
    return shared + rows, shared + chosen


@pytest.mark.parametrize(("n", "i", "o", "k", "other", "micro"), [
    (16, 2048, 2048, 8, 0, 1), (512, 2048, 2048, 8, 0, 1), (64, 300, 40, 3, 1000, 2),
    (4, 10, 2000, 16, 5, 4)])
def test_route_costs_are_the_closed_form(n: int, i: int, o: int, k: int, other: int,
                                         micro: int) -> None:
    costs = route_costs([LinearShape(n, i, o)], other, k, micro, element_size=4,
                        flops_per_byte=8.0)
    matrix, gramian = _closed_form(n, i, o, k, other, micro, 32.0)
    assert costs.matrix == pytest.approx(matrix, rel=1e-12)
    assert costs.gramian == pytest.approx(gramian, rel=1e-12)


def _expected_route(n: int, micro: int) -> str:
    """The closed-form choice on the test mlp (16 -> 32 -> 32 -> 32, K = 3, float64)."""
    matrix = gramian = 0.0
    for i, o in [(16, 32), (32, 32), (32, 32)]:
        m, g = _closed_form(n, i, o, 3, 0, micro, 8.0 * 8)
        matrix, gramian = matrix + m, gramian + g
    ratio = gramian / matrix
    assert ratio >= 1 or ratio <= 1 / _auto.DECISIVE  # no trials here
    return "gramian" if ratio < 1 else "matrix"


def test_the_model_decides_where_it_is_decisive_and_redecides_on_a_new_shape() -> None:
    model, x, y = build("mlp", batch=512, dtype=torch.float64)
    buf = _buffer(model, "auto", {"matrix": 1.0, "gramian": 1.0})
    schedule = [(8,), (8,), (512,), (8,), (512,), (256, 256), (256, 256)]
    stats = _run(model, x, y, buf, UPGrad(), schedule)
    # step 1: the balancer is not known yet; the first (256, 256) step is decided as one
    # micro-batch of 256 rows (the count seen last with that shape), the next with both
    expected = ["matrix"] + [_expected_route(sizes[0], 1) for sizes in schedule[1:6]] + [
        _expected_route(256, 2)]
    assert [s.route for s in stats] == expected
    assert expected[1:5] == ["gramian", "matrix", "gramian", "matrix"]


def test_trials_decide_by_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_auto, "DECISIVE", float("inf"))  # always measure
    for faster in ("matrix", "gramian"):
        model, x, y = build("mlp", batch=16, dtype=torch.float64)
        clock = {"matrix": 1.0, "gramian": 1.0, faster: 0.5}
        buf = _buffer(model, "auto", clock)
        stats = _run(model, x, y, buf, UPGrad(), [(16,)] * 9)
        routes = [s.route for s in stats]
        # step 1: matrix (balancer unknown); then gramian, matrix, gramian, matrix timed
        assert routes[:5] == ["matrix", "gramian", "matrix", "gramian", "matrix"]
        assert routes[5:] == [faster] * 4


# -- state, logs, failures ---------------------------------------------------------------------

def _resume_run(cut: int) -> None:
    schedule = [(16,), (16,), (8, 8), (16,), (12,), (16,), (8, 8), (12,), (16,)]
    model, x, y = build("mlp", batch=16, dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    buf = _buffer(model, "auto")
    balancer = UPGrad()
    _run(model, x, y, buf, balancer, schedule[:cut], opt=opt)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                "buf": buf.state_dict()}, saved)
    straight = _run(model, x, y, buf, balancer, schedule[cut:], opt=opt)

    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    model2, _, _ = build("mlp", batch=16, dtype=torch.float64)
    model2.load_state_dict(state["model"])
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.05)
    opt2.load_state_dict(state["opt"])
    buf2 = _buffer(model2, "auto")
    buf2.load_state_dict(state["buf"])
    resumed = _run(model2, x, y, buf2, UPGrad(), schedule[cut:], opt=opt2)
    assert [s.route for s in resumed] == [s.route for s in straight]
    for a, b in zip(model2.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cut", [1, 3, 6])  # before, during and after the trials
def test_resume_is_bit_identical(cut: int) -> None:
    _resume_run(cut)


def test_states_without_a_route_load_and_bad_ones_raise() -> None:
    model, x, y = build("mlp", batch=16, dtype=torch.float64)
    matrix = _buffer(model, "matrix")
    _run(model, x, y, matrix, UPGrad(), SCHEDULE[:2])
    buf = _buffer(model, "auto")
    buf.load_state_dict(matrix.state_dict())  # a matrix buffer's state: no decisions
    buf.load_state_dict({"update_every": 1, "step": 0, "weights": None, "passes": "loop"})
    assert [s.route for s in _run(model, x, y, buf, UPGrad(), SCHEDULE[:2])] == [
        "matrix", "gramian"]
    state = buf.state_dict()
    bad = {**state, "auto_route": {**state["auto_route"], "decided": [[[1], "features"]]}}
    with pytest.raises(ValueError, match="auto_route"):
        buf.load_state_dict(bad)
    assert buf.state_dict() == state


def test_the_route_is_logged() -> None:
    model, x, y = build("mlp", batch=16, dtype=torch.float64)
    stats = _run(model, x, y, _buffer(model, "auto"), UPGrad(), SCHEDULE[:2])
    assert [stats_to_dict(s)["route/gramian"] for s in stats] == [0.0, 1.0]
    matrix_stats = _run(model, x, y, _buffer(model, "matrix"), UPGrad(), SCHEDULE[:1])
    assert "route/gramian" not in stats_to_dict(matrix_stats[0]) and matrix_stats[0].route is None


class _Failing(UPGrad):
    fail = False

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        if self.fail:
            raise RuntimeError("solver failed")
        return super()._compute_weights(gramian, losses)


def test_a_failed_gramian_step_moves_nothing() -> None:
    model, x, y = build("mlp", batch=16, dtype=torch.float64)
    ref, _, _ = build("mlp", batch=16, dtype=torch.float64)
    buf, ref_buf = _buffer(model, "auto"), _buffer(ref, "matrix")
    balancer = _Failing()
    _run(model, x, y, buf, balancer, SCHEDULE[:1])
    _run(ref, x, y, ref_buf, UPGrad(), SCHEDULE[:1])
    buf.backward(regression_losses(model(x), y))
    assert isinstance(buf._engine, AutoMode) and buf._engine.route == "gramian"
    balancer.fail = True
    with pytest.raises(RuntimeError, match="solver failed"):
        buf.apply_(balancer)
    assert all(p.grad is None for p in model.shared_parameters())
    assert all(p.grad is None for p in model.head_parameters())  # as before the step
    balancer.fail = False
    stats = _run(model, x, y, buf, balancer, SCHEDULE[:1])
    _run(ref, x, y, ref_buf, UPGrad(), SCHEDULE[:1])
    assert stats[0].route == "gramian"
    _close(_params(model), _params(ref))


def test_a_balancer_needing_rows_after_a_gramian_step() -> None:
    model, x, y = build("mlp", batch=16, dtype=torch.float64)
    buf = _buffer(model, "auto")
    _run(model, x, y, buf, UPGrad(), SCHEDULE[:1])  # the next step is the first trial,
    buf.backward(regression_losses(model(x), y))  # on the gramian route
    with pytest.raises(TypeError, match="mode='auto' took the gramian route"):
        buf.apply_(make_balancer("graddrop"))
    buf.reset()
    stats = _run(model, x, y, buf, make_balancer("graddrop"), SCHEDULE[:2])
    assert [s.route for s in stats] == ["matrix", "matrix"]
