"""Clipping: the clipping tutorial's examples (docs/figures.md), per-task caps, AGC's formula,
AutoClip's percentile."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance import (
    AGC,
    AutoClip,
    NonFiniteGradientError,
    TaskAutoClip,
    TaskClip,
    TaskGradBuffer,
    TaskValueClip,
    balanced_backward,
)
from gradbalance.balancers import Sum
from gradbalance.clip import (
    adaptive_clip_grad_,
    clip_task_norms_,
    clip_task_values_,
    suggest_max_norm,
)

# -- the clipping tutorial's examples, exactly -------------------------------------------


def _seed_param() -> torch.Tensor:
    w = torch.tensor([3.0, 4.0], requires_grad=True)
    (w * torch.tensor([30.0, 40.0])).sum().backward()
    return w


def test_seed003_norm_clip_30_40() -> None:
    w = _seed_param()
    before = torch.nn.utils.clip_grad_norm_([w], max_norm=1.0)
    assert before.item() == 50.0
    torch.testing.assert_close(w.grad, torch.tensor([0.6, 0.8]))
    # The same row through the per-task clip: same numbers, same pre-clip norm.
    G = torch.tensor([[30.0, 40.0]])
    norms = clip_task_norms_(G, max_norm=1.0)
    assert norms.tolist() == [50.0]
    torch.testing.assert_close(G[0], torch.tensor([0.6, 0.8]))


def test_seed003_value_clip_30_40() -> None:
    w = _seed_param()
    torch.nn.utils.clip_grad_value_([w], clip_value=5.0)
    assert torch.equal(w.grad, torch.tensor([5.0, 5.0]))
    G = torch.tensor([[30.0, 40.0], [-30.0, 1.0]])
    norms = clip_task_values_(G, clip_value=5.0)
    assert torch.equal(G, torch.tensor([[5.0, 5.0], [-5.0, 1.0]]))
    torch.testing.assert_close(norms, torch.tensor([50.0, math.sqrt(901.0)]))


def test_task_clip_row_equals_torch_clip_grad_norm() -> None:
    # Independent source: torch's own clip_grad_norm_ on each row as a parameter.
    gen = torch.Generator().manual_seed(0)
    G = torch.randn(4, 50, generator=gen) * torch.tensor([[0.1], [1.0], [10.0], [100.0]])
    expected, expected_norms = [], []
    for row in G:
        p = torch.zeros_like(row, requires_grad=True)
        p.grad = row.clone()
        expected_norms.append(torch.nn.utils.clip_grad_norm_([p], max_norm=2.0, norm_type=3.0))
        expected.append(p.grad)
    norms = TaskClip(max_norm=2.0, norm_type=3.0)(G)
    assert torch.equal(G, torch.stack(expected))
    assert torch.equal(norms, torch.stack(expected_norms))


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 5),
    st.integers(1, 30),
    st.floats(1e-3, 1e3),
    st.floats(-6, 6),
    st.sampled_from([1.0, 2.0, math.inf]),
)
def test_per_task_clip_caps_every_row(k: int, p: int, max_norm: float, log_scale: float,
                                      norm_type: float) -> None:
    gen = torch.Generator().manual_seed(k * 31 + p)
    G = torch.randn(k, p, generator=gen, dtype=torch.float64) * 10**log_scale
    original = G.clone()
    norms = clip_task_norms_(G, max_norm, norm_type=norm_type)
    after = torch.linalg.vector_norm(G, ord=norm_type, dim=1)
    assert bool((after <= max_norm * (1 + 1e-12)).all())
    torch.testing.assert_close(norms, torch.linalg.vector_norm(original, ord=norm_type, dim=1))
    for k_ in range(k):
        # rows below the cap untouched; clipped rows keep their direction
        if norms[k_] <= max_norm:
            assert torch.equal(G[k_], original[k_])
        else:
            cos = (G[k_] @ original[k_]) / (G[k_].norm() * original[k_].norm())
            assert cos.item() == pytest.approx(1.0, abs=1e-12)


def test_task_clip_in_step_caps_rows_before_combine() -> None:
    # Two tasks with gradients [30, 40] and [0, 0.5]; TaskClip(1) -> [0.6, 0.8] + [0, 0.5].
    w = torch.zeros(2, requires_grad=True)
    losses = [w @ torch.tensor([30.0, 40.0]), w @ torch.tensor([0.0, 0.5])]
    stats = balanced_backward(losses, Sum(), shared_params=[w], clip=TaskClip(1.0))
    torch.testing.assert_close(w.grad, torch.tensor([0.6, 1.3]))
    torch.testing.assert_close(stats.pre_clip_norms, torch.tensor([50.0, 0.5]))
    # the stats describe the clipped rows the balancer saw
    torch.testing.assert_close(stats.task_norms, torch.tensor([1.0, 0.5], dtype=torch.float64))


def test_value_clip_in_step() -> None:
    w = torch.zeros(2, requires_grad=True)
    losses = [w @ torch.tensor([30.0, 40.0]), w @ torch.tensor([-9.0, 0.5])]
    balanced_backward(losses, Sum(), shared_params=[w], clip=TaskValueClip(5.0))
    torch.testing.assert_close(w.grad, torch.tensor([0.0, 5.5]))


def test_global_clip_composes_with_task_clip() -> None:
    # per-task clip in the step, then the user's global clip on every parameter: the final
    # gradient equals a hand computation of the two stages.
    w = torch.zeros(2, requires_grad=True)
    head = torch.zeros(1, requires_grad=True)
    losses = [w @ torch.tensor([30.0, 40.0]) + 3 * head.sum(),
              w @ torch.tensor([4.0, -3.0]) + 4 * head.sum()]
    balanced_backward(losses, Sum(), shared_params=[w], head_params=[head], clip=TaskClip(1.0))
    trunk = torch.tensor([0.6, 0.8]) + torch.tensor([0.8, -0.6])
    heads = torch.tensor([7.0])
    total = torch.cat([trunk, heads]).norm()
    pre = torch.nn.utils.clip_grad_norm_([w, head], max_norm=2.0)
    torch.testing.assert_close(pre, total)
    torch.testing.assert_close(w.grad, trunk * 2.0 / total, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head.grad, heads * 2.0 / total, rtol=1e-6, atol=1e-6)
    torch.nn.utils.clip_grad_value_([w, head], clip_value=0.1)
    expected = torch.clamp(trunk * 2.0 / total, -0.1, 0.1)
    torch.testing.assert_close(w.grad, expected)
    assert float(head.grad.abs().max()) <= float(torch.tensor(0.1))


def test_task_clip_nonfinite_rows_untouched_or_raise() -> None:
    G = torch.tensor([[float("inf"), 1.0], [30.0, 40.0]])
    norms = clip_task_norms_(G, 1.0)
    assert math.isinf(norms[0].item())
    assert G[0, 0].item() == math.inf and G[0, 1].item() == 1.0
    with pytest.raises(NonFiniteGradientError, match="inf or NaN"):
        clip_task_norms_(torch.tensor([[math.nan, 1.0]]), 1.0, error_if_nonfinite=True)


# -- AGC -------------------------------------------------------------------------------------


def test_agc_matches_formula_on_hand_built_layer() -> None:
    layer = torch.nn.Linear(2, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]]))  # norms 5, 0, 1
        layer.bias.copy_(torch.tensor([0.0, 0.0, 2.0]))  # vector norm 2
    layer.weight.grad = torch.tensor([[0.3, 0.4], [6.0, 8.0], [0.001, 0.0]])  # norms .5, 10, .001
    layer.bias.grad = torch.tensor([1.0, 0.0, 0.0])  # norm 1
    lam, eps = 0.05, 1e-3
    pre = AGC(clip_factor=lam, eps=eps)(layer.parameters())
    # Unit 0: 0.5 / 5 = 0.1 > 0.05 -> scaled to 0.05 * 5 = 0.25 in norm.
    # Unit 1: ‖W‖ = 0 -> max(0, eps) = 1e-3; 10 / 1e-3 > λ -> norm 0.05 * 1e-3 = 5e-5.
    # Unit 2: 0.001 / 1 = 0.001 < 0.05 -> untouched.
    # Bias (vector): 1 / 2 = 0.5 > 0.05 -> norm 0.1.
    expected_w = torch.tensor([[0.15, 0.2], [3e-5, 4e-5], [0.001, 0.0]])
    torch.testing.assert_close(layer.weight.grad, expected_w)
    torch.testing.assert_close(layer.bias.grad, torch.tensor([0.1, 0.0, 0.0]))
    torch.testing.assert_close(pre, torch.tensor(math.sqrt(0.25 + 100 + 1e-6 + 1)))


def test_agc_conv_units_and_exclude() -> None:
    conv = torch.nn.Conv2d(2, 4, 3)
    head = torch.nn.Linear(4, 1)
    gen = torch.Generator().manual_seed(1)
    for p in [*conv.parameters(), *head.parameters()]:
        p.grad = torch.randn(p.shape, generator=gen) * 10
    head_before = [p.grad.clone() for p in head.parameters()]
    w_before = conv.weight.grad.clone()
    adaptive_clip_grad_([*conv.parameters(), *head.parameters()], clip_factor=0.01,
                        exclude=head.parameters())
    for p, g in zip(head.parameters(), head_before):
        assert torch.equal(p.grad, g)
    # per output channel: ratio now at most 0.01 (numpy as the independent norm)
    wn = np.linalg.norm(conv.weight.detach().numpy().reshape(4, -1), axis=1)
    gn = np.linalg.norm(conv.weight.grad.numpy().reshape(4, -1), axis=1)
    np.testing.assert_allclose(gn, 0.01 * np.maximum(wn, 1e-3), rtol=1e-5)
    # direction of each unit kept
    cos = torch.nn.functional.cosine_similarity(conv.weight.grad.reshape(4, -1),
                                                w_before.reshape(4, -1))
    torch.testing.assert_close(cos, torch.ones(4))


def test_agc_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"Invalid clip_factor: -1"):
        AGC(clip_factor=-1)
    with pytest.raises(ValueError, match=r"Invalid eps: nan"):
        AGC(eps=float("nan"))


# -- AutoClip --------------------------------------------------------------------------------


def _set_grad(w: torch.Tensor, norm: float) -> None:
    w.grad = torch.tensor([norm * 0.6, norm * 0.8], dtype=torch.float64)


def test_autoclip_threshold_is_percentile_of_history() -> None:
    w = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    clipper = AutoClip(percentile=30, history_size=5)
    gen = np.random.default_rng(0)
    seen: list[float] = []
    for _ in range(12):
        norm = float(gen.uniform(0.1, 10))
        _set_grad(w, norm)
        pre = clipper([w])
        seen.append(norm)
        window = seen[-5:]  # bounded history, current norm included
        expected = float(np.percentile(window, 30))
        assert pre.item() == pytest.approx(norm, rel=1e-12)
        assert clipper.threshold is not None
        assert clipper.threshold.item() == pytest.approx(expected, rel=1e-12)
        assert w.grad.norm().item() == pytest.approx(min(norm, expected), rel=1e-5)
    np.testing.assert_allclose(clipper.history[:, 0].numpy(), seen[-5:])


def test_autoclip_ignores_nonfinite_and_keeps_state() -> None:
    w = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    clipper = AutoClip(percentile=50, history_size=4)
    for n in (1.0, 2.0, 3.0):
        _set_grad(w, n)
        clipper([w])
    state = clipper.state_dict()
    w.grad = torch.tensor([math.inf, 1.0], dtype=torch.float64)
    pre = clipper([w])
    assert math.isinf(pre.item())
    assert w.grad[1].item() == 1.0  # not clipped
    after = clipper.state_dict()
    assert torch.equal(after["history"], state["history"]) and after["count"] == 3
    with pytest.raises(NonFiniteGradientError, match="history is unchanged"):
        AutoClip(error_if_nonfinite=True)([w])


def test_autoclip_state_round_trip_into_fresh_object() -> None:
    w = torch.zeros(2, dtype=torch.float64, requires_grad=True)
    a = AutoClip(percentile=20, history_size=3)
    for n in (5.0, 1.0, 3.0, 4.0):
        _set_grad(w, n)
        a([w])
    b = AutoClip(percentile=20, history_size=3)
    b.load_state_dict(a.state_dict())
    for n in (10.0, 0.5):
        _set_grad(w, n)
        ga = (a([w]), w.grad.clone())
        _set_grad(w, n)
        gb = (b([w]), w.grad.clone())
        assert torch.equal(ga[0], gb[0]) and torch.equal(ga[1], gb[1])
    assert torch.equal(a.threshold, b.threshold)
    a.reset()
    assert a.threshold is None and a.history.numel() == 0
    with pytest.raises(ValueError, match="history_size=4"):
        AutoClip(history_size=4).load_state_dict(b.state_dict())


def test_task_autoclip_per_task_histories_numpy() -> None:
    clipper = TaskAutoClip(percentile=75, history_size=3)
    gen = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(5):
        G = torch.randn(2, 6, generator=gen, dtype=torch.float64) * torch.tensor([[1.0], [50.0]])
        rows.append(G.norm(dim=1).numpy())
        original = G.clone()
        norms = clipper(G)
        expected = np.percentile(np.stack(rows[-3:]), 75, axis=0)
        np.testing.assert_allclose(clipper.threshold.numpy(), expected, rtol=1e-12)
        np.testing.assert_allclose(norms.numpy(), rows[-1])
        np.testing.assert_allclose(G.norm(dim=1).numpy(), np.minimum(rows[-1], expected),
                                   rtol=1e-6)
        assert bool(((G * original).sum(1) > 0).all())


def test_task_autoclip_refuses_another_row_count_naming_the_fixes() -> None:
    """One history per row: another number of rows (a smaller last batch under
    ``batch_dim=0``) is refused with the fixes, the history and the rows untouched."""
    clipper = TaskAutoClip(history_size=4)
    clipper(torch.randn(3, 5, dtype=torch.float64))
    before = clipper.state_dict()
    rows = torch.randn(2, 5, dtype=torch.float64)
    original = rows.clone()
    with pytest.raises(ValueError, match=r"got 2 norms but the history holds 3 .*"
                                         r"drop_last=True.*TaskClip"):
        clipper(rows)
    assert torch.equal(rows, original)
    after = clipper.state_dict()
    assert torch.equal(after["history"], before["history"])
    assert after["count"] == before["count"] and after["position"] == before["position"]


def test_task_autoclip_in_step() -> None:
    w = torch.zeros(2, requires_grad=True)
    buf = TaskGradBuffer([w])
    clipper = TaskAutoClip(percentile=0, history_size=10)  # 0th percentile: the minimum
    for scale in (1.0, 2.0):
        buf.backward([w @ torch.tensor([3.0, 4.0]) * scale, w @ torch.tensor([0.0, 1.0])])
        w.grad = None
        stats = buf.apply_(Sum(), clip=clipper)
    # second step: task 0 norm 10 clipped to the history minimum 5; task 1 unchanged
    torch.testing.assert_close(stats.pre_clip_norms, torch.tensor([10.0, 1.0]))
    torch.testing.assert_close(w.grad, torch.tensor([3.0, 5.0]), rtol=1e-5, atol=1e-6)


def test_suggest_max_norm_matches_numpy() -> None:
    norms = np.random.default_rng(1).lognormal(size=500)
    logged = [*norms.tolist(), math.inf, math.nan]
    assert suggest_max_norm(logged) == pytest.approx(float(np.percentile(norms, 95)), rel=1e-12)
    assert suggest_max_norm(torch.tensor(norms), 90) == pytest.approx(
        float(np.percentile(norms, 90)), rel=1e-12)
    with pytest.raises(ValueError, match="no finite value"):
        suggest_max_norm([math.nan])
    with pytest.raises(ValueError, match=r"Invalid percentile: 101"):
        suggest_max_norm([1.0], 101)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: TaskClip(0.0), r"Invalid max_norm: 0.0 \(expected a finite number > 0\)"),
        (lambda: TaskClip(1.0, norm_type=0.5), r"Invalid norm_type: 0.5"),
        (lambda: TaskValueClip(-1), r"Invalid clip_value: -1"),
        (lambda: AutoClip(percentile=-1), r"Invalid percentile: -1"),
        (lambda: AutoClip(history_size=0), r"Invalid history_size: 0"),
    ],
)
def test_bad_arguments(build, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()


@pytest.mark.parametrize("make", [AutoClip, AGC], ids=["autoclip", "agc"])
def test_gradient_tensors_instead_of_parameters_raise(make: type) -> None:
    """Known failure elsewhere: a clip given the gradients (not the parameters) does nothing."""
    w = torch.ones(3, requires_grad=True)
    (w * 40.0).sum().backward()
    with pytest.raises(ValueError, match=r"parameters\[0\].*not the gradient tensors"):
        make()([w.grad])
    assert torch.equal(w.grad, torch.full((3,), 40.0))
