"""The contract every registered balancer keeps (parametrised over ``gradbalance.BALANCERS``).

The registry is read at collection time, so every balancer module that lands is checked.
Each balancer is built by :func:`make`: ``num_tasks=K`` and a seeded ``generator`` when the
constructor takes them, or an entry of ``support.balancers.FACTORY`` for classes that need other
arguments.
"""

from __future__ import annotations

import inspect
import io
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor

import gradbalance
from gradbalance import NonFiniteGradientError
from gradbalance.balancers import Balancer
from gradbalance.functional import combine_rows, compute_gramian
from support.balancers import FACTORY, build_balancer
from support.declared_state import (
    assert_every_tensor_declared,
    assert_replaced_not_edited,
    assert_task_sized_state_declared,
    damaged_states,
    task_shapes,
)
from support.loop_state import assert_same_state

NAMES = sorted(gradbalance.BALANCERS)

#: Contract gaps of methods still being worked on: (test, balancer) -> reason. Each runs as a
#: strict xfail, so the entry must be removed (the suite fails) once the method is fixed.
KNOWN_GAPS: dict[tuple[str, str], str] = {}

K, P = 3, 24

#: Where the rules checked here are written down.
RULES = 'docs/ARCHITECTURE.md, "Extension contract"'


def rule(text: str) -> str:
    """A failure message: the rule broken and where it is written."""
    return f"{text} ({RULES}, \"{text.split(':')[0]}\")" if ":" in text else f"{text} ({RULES})"


def with_rule(text: str) -> Callable[[str], str]:
    """``assert_close``'s ``msg``: its own report, then the rule."""
    return lambda report: f"{report}\n{rule(text)}"


def make(name: str, k: int | None = K, seed: int = 0) -> Balancer:
    """The balancer under test (see :func:`support.balancers.build_balancer`)."""
    return build_balancer(name, k, seed)


def takes_num_tasks(name: str) -> bool:
    return name not in FACTORY and "num_tasks" in inspect.signature(
        gradbalance.BALANCERS[name]).parameters


def takes_generator(name: str) -> bool:
    return "generator" in inspect.signature(gradbalance.BALANCERS[name]).parameters


def matrix(seed: int, k: int = K, p: int = P, dtype: torch.dtype = torch.float64) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(k, p, generator=gen, dtype=torch.float64).to(dtype)


def losses_for(seed: int, k: int = K) -> Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    return torch.rand(k, generator=gen, dtype=torch.float64) + 0.5


def run(b: Balancer, seed: int, k: int = K, dtype: torch.dtype = torch.float64) -> Tensor:
    return b(matrix(seed, k, dtype=dtype), losses_for(seed, k))


def snapshot(b: Balancer) -> dict[str, Any]:
    """A deep copy of the state, through torch.save (as a checkpoint would)."""
    buf = io.BytesIO()
    torch.save(b.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.fixture(params=NAMES)
def name(request: pytest.FixtureRequest) -> str:
    gap = KNOWN_GAPS.get((request.function.__name__, request.param))
    if gap is not None:
        request.node.add_marker(pytest.mark.xfail(reason=gap, strict=True))
    return request.param


def test_registry_entry_is_declared(name: str) -> None:
    cls = gradbalance.BALANCERS[name]
    assert cls.name == name and name == name.lower(), rule(
        f"Registered by name: {cls.__name__}.name is {cls.name!r}, the lower-case registry key")
    assert isinstance(cls.from_gramian, bool) and isinstance(cls.homogeneous, bool), rule(
        f"Flags declared, not inferred: {cls.__name__}'s from_gramian and homogeneous are bools")
    b = make(name)
    assert b.num_tasks == K, rule(f"Flags declared, not inferred: {cls.__name__}(num_tasks={K}) "
                                  f"keeps num_tasks (pass it to Balancer.__init__)")
    assert repr(b).startswith(type(b).__name__)
    assert b.weight_degree is None or isinstance(b.weight_degree, float), rule(
        f"Flags declared, not inferred: weight_degree is a float or None, found "
        f"{b.weight_degree!r}, a {type(b.weight_degree).__name__} (write 0.0 or -0.5, not 0)")
    if b.homogeneous and b.weight_degree is not None:  # B(sG) = s B(G) needs δ = 0
        assert b.weight_degree == 0.0, rule(
            f"A scaling law or none: homogeneous=True needs weight_degree 0.0, found "
            f"{b.weight_degree!r}; a scale-free method declares homogeneous = False")
    if b.weight_degree is not None:
        assert b.from_gramian, rule("Flags declared, not inferred: weight_degree is for weighted "
                                    "balancers (from_gramian = True)")


def test_declared_min_tasks_is_the_smallest_k_that_runs(name: str) -> None:
    m = make(name).min_tasks
    if not takes_num_tasks(name):
        pytest.skip("K is fixed at construction")
    assert bool(torch.isfinite(run(make(name, k=None), 0, k=m)).all()), rule(
        f"Flags declared, not inferred: min_tasks={m} must run (finite) at K = {m}")
    if m > 1:
        try:
            run(make(name, k=None), 0, k=m - 1)
        except ValueError:
            return
        pytest.fail(rule(f"Flags declared, not inferred: min_tasks={m}, so K = {m - 1} must "
                         f"raise ValueError"))


def test_runs_sharded(name: str) -> None:
    """A matrix balancer implements ``_combine_matrix_sharded`` (weighted ones need nothing)."""
    assert make(name).shardable, rule(
        "Every matrix balancer is shardable: implement _combine_matrix_sharded")


def test_every_state_tensor_is_declared(name: str) -> None:
    b = make(name)
    run(b, 0)
    assert_every_tensor_declared(b)


def test_state_whose_size_is_k_is_declared_per_task(name: str) -> None:
    a, b = make(name), make(name, k=K + 1)
    run(a, 0)
    run(b, 0, k=K + 1)
    assert_task_sized_state_declared(a, task_shapes(a), task_shapes(b), K)


def test_state_is_replaced_never_edited_in_place(name: str) -> None:
    b = make(name)
    run(b, 0)
    assert_replaced_not_edited(b, lambda: [run(b, seed) for seed in (1, 2)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_shape_dtype_device_finite(name: str, dtype: torch.dtype) -> None:
    b = make(name)
    g = matrix(0, dtype=dtype)
    result = b.combine(g, losses_for(0))
    out = result.vector
    assert out.shape == (P,) and out.dtype == dtype and out.device == g.device, rule(
        f"The update is the rows' kind: shape {(P,)}, dtype {dtype}; found "
        f"{tuple(out.shape)}, {out.dtype}")
    assert bool(torch.isfinite(out).all()), rule("The update is the rows' kind: finite")
    if result.weights is not None:
        assert result.weights.shape == (K,) and bool(torch.isfinite(result.weights).all()), rule(
            f"The update is the rows' kind: weights [K] and finite, found {result.weights}")


def test_single_task_gives_a_nonnegative_multiple_of_its_gradient(name: str) -> None:
    if make(name).min_tasks > 1:
        with pytest.raises(ValueError):
            make(name, k=1)(matrix(0, k=1), losses_for(0, k=1))
        return
    b = make(name, k=1)
    g = matrix(0, k=1)
    out = b(g, losses_for(0, k=1))
    row = g[0]
    coef = (out @ row) / (row @ row)
    single = "The update is the rows' kind: one task gives a non-negative multiple of its row"
    assert bool(torch.isfinite(out).all()) and coef >= 0, rule(f"{single}, found coef {coef}")
    torch.testing.assert_close(out, coef * row, rtol=1e-9, atol=1e-12, msg=with_rule(single))


def test_zero_gradients_give_zero_update(name: str) -> None:
    if make(name).min_tasks > K:
        pytest.skip("needs more tasks")
    b = make(name)
    out = b(torch.zeros(K, P, dtype=torch.float64), losses_for(0))
    assert bool(torch.isfinite(out).all()) and bool((out == 0).all()), rule(
        "The update is the rows' kind: all-zero rows give exactly zero")


def test_one_zero_row_and_duplicate_rows_are_finite(name: str) -> None:
    g = matrix(1)
    with_zero = g.clone()
    with_zero[1] = 0
    dup = g.clone()
    dup[2] = dup[0]
    for label, m in (("a zero row", with_zero), ("duplicate rows", dup)):
        out = make(name)(m, losses_for(1))
        assert bool(torch.isfinite(out).all()), rule(
            f"The update is the rows' kind: finite with {label}")


@pytest.mark.parametrize("scale", [1e-8, 1e-4, 1e4, 1e8])
def test_extreme_scales(name: str, scale: float) -> None:
    # float32 input: the common training dtype, where overflow/underflow would show first.
    g = matrix(2, dtype=torch.float32)
    out = make(name)(g * scale, losses_for(2))
    assert bool(torch.isfinite(out).all()), rule(
        f"The update is the rows' kind: finite for float32 rows scaled by {scale:g}")
    if gradbalance.BALANCERS[name].homogeneous:
        g64 = matrix(2)
        scaled = make(name)(g64 * scale, losses_for(2))
        base = make(name)(g64, losses_for(2))
        torch.testing.assert_close(scaled / scale, base, rtol=1e-6, atol=1e-12, msg=with_rule(
            f"A scaling law or none: {name} is declared homogeneous (B(s·G) = s·B(G)) but is "
            f"not; declare homogeneous = False and its weight_degree (or None)"))


def test_declared_scaling_law_over_several_steps(name: str) -> None:
    """Scaling every input of a run by s scales every output by s^a, ``a`` the declared
    ``homogeneous_degree`` (stateful methods too)."""
    a, b = make(name), make(name)
    degree = a.homogeneous_degree
    if degree is None:
        pytest.skip("no scaling law (a step size or an eps in gradient units)")
    s = 1e3
    for seed in range(3):
        g, lo = matrix(seed), losses_for(seed)
        torch.testing.assert_close(a(s * g, lo) / s**degree, b(g, lo), rtol=1e-6, atol=1e-12,
                                   msg=with_rule(
            f"A scaling law or none: {name} declares B(s·G) = s^{degree:g}·B(G) (homogeneous="
            f"{a.homogeneous}, weight_degree={a.weight_degree}) and breaks it"))


@pytest.mark.parametrize("bad", [42, "0", 1.5, None.__class__], ids=["int", "str", "float", "type"])
@pytest.mark.parametrize("generator_owner", [n for n in NAMES if takes_generator(n)])
def test_generator_must_be_a_torch_generator(generator_owner: str, bad: object) -> None:
    """A seed or another object given as the generator is refused at construction."""
    name = generator_owner
    kwargs: dict[str, Any] = {"num_tasks": K} if takes_num_tasks(name) else {}
    seed = bad if isinstance(bad, int) else 0
    with pytest.raises(ValueError, match=(
            rf"Invalid generator: {type(bad).__name__} {re.escape(repr(bad))} \(expected a "
            rf"torch\.Generator or None; .*generator=torch\.Generator\(\)\.manual_seed\({seed}\)")):
        gradbalance.BALANCERS[name](generator=bad, **kwargs)


def test_deterministic_with_seeded_generator(name: str) -> None:
    a, b = make(name, seed=5), make(name, seed=5)
    for seed in range(3):
        assert torch.equal(run(a, seed), run(b, seed))


def test_state_round_trip_is_bit_identical(name: str) -> None:
    a = make(name, seed=0)
    for seed in range(3):
        run(a, seed)
    saved = snapshot(a)
    fresh = make(name, seed=123)  # another seed: the generator state must come from the save
    fresh.load_state_dict(saved)
    assert_same_state(snapshot(fresh), saved)
    for seed in range(3, 6):
        assert torch.equal(run(fresh, seed), run(a, seed))


def test_reset_forgets_state(name: str) -> None:
    if takes_generator(name):
        pytest.skip("the random stream is the generator's, not reset by the balancer")
    a = make(name)
    for seed in range(3):
        run(a, seed)
    a.reset()
    b = make(name)
    for seed in range(3, 5):
        assert torch.equal(run(a, seed), run(b, seed))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_raises_and_keeps_state(name: str, bad: float) -> None:
    a, twin = make(name), make(name)
    for seed in range(2):
        run(a, seed)
        run(twin, seed)
    before = snapshot(a)
    g = matrix(9)
    g[1, 3] = bad
    with pytest.raises(NonFiniteGradientError):
        a(g, losses_for(9))
    assert_same_state(snapshot(a), before)
    assert torch.equal(run(a, 10), run(twin, 10))


def test_nonfinite_losses_raise_when_read(name: str) -> None:
    b = make(name)
    if not b.needs_losses:
        pytest.skip("does not read the losses")
    before = snapshot(b)
    lo = losses_for(0)
    lo[0] = float("nan")
    with pytest.raises(NonFiniteGradientError):
        b(matrix(0), lo)
    assert_same_state(snapshot(b), before)


def test_wrong_number_of_tasks_raises(name: str) -> None:
    if make(name).min_tasks > K:
        pytest.skip("needs more tasks")
    b = make(name)
    with pytest.raises(ValueError):
        b(matrix(0, k=K + 1), losses_for(0, k=K + 1))
    with pytest.raises(ValueError):
        b(matrix(0), losses_for(0, k=K + 1))


def test_stateful_balancer_rejects_a_new_task_count(name: str) -> None:
    """Built without K, a balancer whose state depends on K refuses another K later."""
    if not takes_num_tasks(name):
        pytest.skip("K is fixed at construction")
    b = make(name, k=None)
    run(b, 0, k=K + 1)
    state = {k: v for k, v in b.state_dict().items() if "generator" not in k}
    if not any(isinstance(v, Tensor) and v.dim() > 0 for v in state.values()):
        pytest.skip("no per-task state")
    with pytest.raises(ValueError):
        run(b, 1, k=K + 2)


@pytest.mark.parametrize("seed", [0, 1])
def test_damaged_state_is_refused_and_nothing_moves(name: str, seed: int) -> None:
    """A state tensor with inf/NaN or another number of tasks is refused by the load; the
    balancer keeps its state and its next update."""
    a, twin = make(name, seed=seed), make(name, seed=seed)
    for step in range(2):
        run(a, seed + step)
        run(twin, seed + step)
    before = snapshot(a)
    damages = list(damaged_states(a, seed))
    if not damages:
        pytest.skip("no declared state tensor")
    for label, state in damages:
        with pytest.raises(ValueError, match=r"inf/NaN|task|shape"):
            a.load_state_dict(state)
        assert_same_state(snapshot(a), before, label)
    assert torch.equal(run(a, 7), run(twin, 7))


@pytest.mark.parametrize("extra", [1, 2])
@pytest.mark.parametrize("built_with_k", [True, False])
def test_state_of_another_task_count_is_refused(name: str, extra: int,
                                                built_with_k: bool) -> None:
    """A balancer that tracks K tasks (its setting, or its state from earlier calls) refuses a
    whole state saved with K + extra tasks, and keeps its own."""
    if make(name).min_tasks > K:
        pytest.skip("needs more tasks")
    if not built_with_k and not takes_num_tasks(name):
        pytest.skip("K is fixed at construction")
    saver = make(name, k=K + extra)
    run(saver, 0, k=K + extra)
    saved = snapshot(saver)
    if not any(spec.task_dim is not None and isinstance(saved.get(key), Tensor)
               for key, spec in saver.state_specs.items()):
        pytest.skip("no per-task state")
    a = make(name, k=K if built_with_k else None)
    run(a, 0)
    before = snapshot(a)
    with pytest.raises(ValueError, match=r"num_tasks|shape"):
        a.load_state_dict(saved)
    assert_same_state(snapshot(a), before)


def test_weighted_combine_is_weights_times_rows(name: str) -> None:
    a, b = make(name), make(name)
    g, lo = matrix(4), losses_for(4)
    result = a.combine(g, lo)
    if a.from_gramian:
        w = b.compute_weights(compute_gramian(g), lo)
        assert result.weights is not None
        torch.testing.assert_close(result.weights, w, rtol=0, atol=0)
        torch.testing.assert_close(result.vector, w @ g, rtol=1e-12, atol=1e-12)
    elif result.weights is not None:
        torch.testing.assert_close(result.vector, combine_rows(result.weights, g),
                                   rtol=1e-12, atol=1e-12)
    else:
        with pytest.raises(TypeError):
            b.compute_weights(compute_gramian(g), lo)
