"""Gradient modes: gramian and features against matrix mode and against closed forms."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from gradbalance import BALANCERS, TaskGradBuffer, balanced_backward
from gradbalance import gramian as gramian_module
from gradbalance.balancers import Balancer, Sum
from gradbalance.gramian import linear_gramian
from support.helpers import TRUNKS, build, grads_of, losses_of
from support.perf import default_weighted, make_balancer, step

WEIGHTED = [*default_weighted(), "constant"]
#: Every weighted balancer on the MLP; the trunk-dependent part (the Gramian engine) is
#: independent of the balancer, so the other trunks run a few representative methods.
CASES = [("mlp", n) for n in WEIGHTED] + [
    (kind, n) for kind in TRUNKS[1:] for n in ("pcgrad", "mgda", "upgrad", "constant")
    if n in WEIGHTED
]


def _close(actual: list[torch.Tensor], expected: list[torch.Tensor], rtol: float = 1e-5) -> None:
    for a, e in zip(actual, expected):
        scale = float(e.abs().max()) if e.numel() else 0.0
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * max(scale, 1e-12))


@pytest.mark.parametrize(("kind", "name"), CASES)
def test_gramian_mode_equals_matrix_mode(kind: str, name: str) -> None:
    trunk_m, heads_m, stats_m = step(kind, make_balancer(name), "matrix")
    trunk_g, heads_g, stats_g = step(kind, make_balancer(name), "gramian")
    _close(trunk_g, trunk_m)
    _close(heads_g, heads_m)
    assert stats_g.mode == "gramian"
    torch.testing.assert_close(stats_g.task_norms, stats_m.task_norms, rtol=1e-6, atol=0.0)
    torch.testing.assert_close(stats_g.cosine, stats_m.cosine, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(stats_g.update_norm, stats_m.update_norm, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("kind", TRUNKS)
def test_sum_in_every_mode_is_the_plain_step(kind: str) -> None:
    # Sum is linear, so even the feature-level method gives sum(losses).backward().
    model, x, y = build(kind, dtype=torch.float64)
    losses_of(model, x, y).sum().backward()
    trunk_ref, heads_ref = grads_of(model.shared_parameters()), grads_of(model.head_parameters())
    for mode in ("matrix", "gramian", "features"):
        trunk, heads, stats = step(kind, Sum(), mode)
        _close(trunk, trunk_ref, rtol=1e-9)
        _close(heads, heads_ref, rtol=1e-9)
        assert stats.mode == mode and not stats.found_inf


def _linear_rows(x: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Per-task weight gradients ``Dₖᵀ x``, flattened, by a plain loop."""
    return torch.stack([(d[k].T @ x).reshape(-1) for k in range(d.shape[0])])


@pytest.mark.parametrize("route", [None, "rows", "activations"])
@pytest.mark.parametrize(("n", "i", "o"), [(4, 64, 64), (64, 3, 2)])
def test_linear_gramian_routes_match_materialised_rows(n: int, i: int, o: int, route: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # (4, 64, 64) takes the activation route unforced, (64, 3, 2) the row route; the
    # activation route in chunks of one task (the chunk size lowered to force several)
    monkeypatch.setattr(gramian_module, "_GRAM_CHUNK", 1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, i, generator=gen, dtype=torch.float64)
    d = torch.randn(3, n, o, generator=gen, dtype=torch.float64)
    rows = _linear_rows(x, d)
    bias = d.sum(dim=1)
    expected = rows @ rows.T + bias @ bias.T
    torch.testing.assert_close(linear_gramian(x, d, True, True, route=route), expected)
    torch.testing.assert_close(linear_gramian(x, d, True, False, route=route), rows @ rows.T)
    with pytest.raises(ValueError, match="Invalid route: 'ghost'"):
        linear_gramian(x, d, True, True, route="ghost")


def test_gramian_mode_holds_no_k_by_p_matrix() -> None:
    model, x, y = build("mlp")
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="gramian",
                         modules=model.trunk)
    buf.backward(losses_of(model, x, y))
    assert buf.matrix is None and buf._engine.matrix is None
    buf.apply_(Sum())
    assert buf._engine.matrix is None


def test_gramian_mode_with_grad_scaler_gives_fp32_answer() -> None:
    name = "mgda" if "mgda" in BALANCERS else "mean"
    trunk_ref, heads_ref, stats_ref = step("mlp", make_balancer(name), "matrix",
                                           dtype=torch.float32)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    assert scaler.is_enabled()
    trunk, heads, stats = step("mlp", make_balancer(name), "gramian", dtype=torch.float32,
                               scaler=scaler)
    assert stats.loss_scale == 2.0**12
    _close([g / 2.0**12 for g in trunk], trunk_ref)
    _close([g / 2.0**12 for g in heads], heads_ref)
    torch.testing.assert_close(stats.task_norms, stats_ref.task_norms, rtol=1e-5, atol=0.0)
    assert stats.weights is not None and stats_ref.weights is not None
    torch.testing.assert_close(stats.weights, stats_ref.weights, rtol=1e-5, atol=1e-7)


def test_gramian_mode_nonfinite_with_scaler_writes_nonfinite_and_skips_balancer() -> None:
    w = nn.Linear(2, 1, bias=False)
    buf = TaskGradBuffer(list(w.parameters()), mode="gramian", modules=w)
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    out = w(torch.tensor([[1.0, 2.0]])).sum()
    buf.backward([out * float("inf"), out], scaler=scaler)
    stats = buf.apply_(Sum(), scaler=scaler)
    assert stats.found_inf
    assert not bool(torch.isfinite(w.weight.grad).all())


# -- features mode --------------------------------------------------------------------------

class _InverseNorm(Balancer):
    """Test-only weighted balancer: ``wₖ = 1 / ‖gₖ‖`` (sum of unit vectors)."""

    name = ""
    from_gramian = True

    def _compute_weights(self, gramian: torch.Tensor,
                         losses: torch.Tensor | None = None) -> torch.Tensor:
        return 1.0 / torch.diagonal(gramian).sqrt()


def test_features_mode_closed_form() -> None:
    # feats = W x with W = I and x = (1, 2); L1 = h1·feats with h1 = (3, 4); L2 = 5·feats_1.
    # Feature gradients z1 = (3, 4), z2 = (5, 0): unit vectors sum to d = (1.6, 0.8), and
    # ∂/∂W of d·(W x) is d xᵀ = [[1.6, 3.2], [0.8, 1.6]]. The head gets its plain gradient x.
    trunk = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        trunk.weight.copy_(torch.eye(2))
    h1 = torch.tensor([3.0, 4.0], requires_grad=True)
    x = torch.tensor([[1.0, 2.0]])
    feats = trunk(x)
    losses = torch.stack([(feats[0] * h1).sum(), 5 * feats[0, 0]])
    stats = balanced_backward(losses, _InverseNorm(), shared_params=list(trunk.parameters()),
                              head_params=[h1], mode="features", features=feats)
    torch.testing.assert_close(trunk.weight.grad, torch.tensor([[1.6, 3.2], [0.8, 1.6]]))
    torch.testing.assert_close(h1.grad, torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(stats.task_norms, torch.tensor([5.0, 5.0], dtype=torch.float64))
    torch.testing.assert_close(stats.cosine[0, 1], torch.tensor(0.6, dtype=torch.float64))
    assert stats.mode == "features"


def test_features_mode_differs_from_matrix_for_nonlinear_balancer() -> None:
    # Labelled as a different method: on a real trunk the two updates are not the same.
    trunk_m, _, _ = step("mlp", _InverseNorm(), "matrix")
    trunk_f, _, _ = step("mlp", _InverseNorm(), "features")
    assert any(not torch.allclose(a, b, rtol=1e-3) for a, b in zip(trunk_f, trunk_m))


# -- errors ---------------------------------------------------------------------------------

def test_gramian_mode_errors() -> None:
    model, x, y = build("mlp")
    shared, heads = model.shared_parameters(), model.head_parameters()
    with pytest.raises(ValueError, match="mode='gramian' needs modules="):
        TaskGradBuffer(shared, heads, mode="gramian")
    with pytest.raises(ValueError, match=r"shared_params\[0\].*not a parameter of any module"):
        TaskGradBuffer(shared, heads, mode="gramian", modules=model.heads)
    with pytest.raises(ValueError, match="Invalid mode: 'fast'"):
        TaskGradBuffer(shared, heads, mode="fast")  # type: ignore[arg-type]
    buf = TaskGradBuffer(shared, heads, mode="gramian", modules=model.trunk)
    buf.backward(losses_of(model, x, y))
    matrix_only = [n for n, c in BALANCERS.items() if not c.from_gramian]
    if matrix_only:
        with pytest.raises(TypeError, match="needs the task-gradient rows"):
            buf.apply_(BALANCERS[matrix_only[0]]())
    with pytest.raises(ValueError, match="cannot use mode='gramian'"):
        balanced_backward(losses_of(model, x, y), Sum(), shared_params=shared, mode="gramian")


def test_gramian_mode_rejects_inplace_after_block() -> None:
    # the activations route reads the layer's output after the forward: an in-place edit
    # is refused there; the rows route (autograd's own weight gradients) is exact anyway
    trunk = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    buf = TaskGradBuffer(list(trunk.parameters()), mode="gramian", modules=trunk)
    buf._engine.recorder.force = "activations"  # type: ignore[attr-defined]
    out = trunk(torch.randn(5, 3))
    with pytest.raises(RuntimeError, match="modified in place"):
        buf.backward([out[:, 0].mean(), out[:, 1].mean()])


def test_features_mode_errors() -> None:
    model, x, y = build("mlp")
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="features")
    with pytest.raises(ValueError, match="mode='features' needs features="):
        buf.backward(losses_of(model, x, y))
    feats = model.trunk(x)
    buf.backward(torch.stack([head(feats).mean() for head in model.heads]), features=feats)
    feats = model.trunk(x)
    with pytest.raises(ValueError, match="mode='features' takes one backward\\(\\) per step"):
        buf.backward(torch.stack([head(feats).mean() for head in model.heads]), features=feats)
    plain = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    with pytest.raises(ValueError, match="features is only used with mode='features'"):
        plain.backward(losses_of(model, x, y), features=model.trunk(x))


def test_matrix_mode_keeps_clip_and_other_modes_refuse_it() -> None:
    model, x, _ = build("mlp")
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(), mode="features")
    feats = model.trunk(x)
    buf.backward(torch.stack([head(feats).mean() for head in model.heads]), features=feats)
    with pytest.raises(ValueError, match="clip needs the task-gradient rows"):
        buf.apply_(Sum(), clip=lambda m: m.norm(dim=1))


class _TiedTrunk(nn.Module):
    """A conv whose weight is also used outside its forward, an unused LayerNorm, and a
    linear layer called with a keyword argument."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(1, 2, 3, padding=1)
        self.unused = nn.LayerNorm(8)
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x.unsqueeze(1))).flatten(1)[:, :8] * self.conv.weight.sum()
        return torch.tanh(self.out(input=h))


@pytest.mark.parametrize("name", ["upgrad", "pcgrad"])
def test_gramian_mode_takes_other_blocks_parameters_however_they_are_used(name: str) -> None:
    # Non-linear blocks' rows come from the task passes themselves, so a parameter used
    # outside its module, or a module never called, still gets matrix mode's gradient.
    grads = {}
    for mode in ("matrix", "gramian"):
        torch.manual_seed(0)
        trunk = _TiedTrunk().double()
        heads = [nn.Linear(8, 1).double() for _ in range(3)]
        shared = list(trunk.parameters())
        buf = TaskGradBuffer(shared, [p for h in heads for p in h.parameters()], mode=mode,
                             **({"modules": trunk} if mode == "gramian" else {}))
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        feats = trunk(x)
        buf.backward([h(feats).pow(2).mean() * (k + 1) for k, h in enumerate(heads)])
        buf.apply_(make_balancer(name))
        grads[mode] = grads_of(shared)
    _close(grads["gramian"], grads["matrix"], rtol=1e-9)
    assert all(bool((g == 0).all()) for g in grads["gramian"][2:4])  # the unused LayerNorm


class _LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``B A x`` (LoRA)."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width).requires_grad_(False)
        self.lora_a = nn.Linear(width, rank, bias=False)
        self.lora_b = nn.Linear(rank, width, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def test_gramian_mode_on_lora_adapters_of_a_frozen_trunk() -> None:
    # The fine-tuning regime: only the adapters are shared parameters; the frozen layers
    # get no hooks and no gradient.
    grads = {}
    for mode in ("matrix", "gramian"):
        torch.manual_seed(0)
        trunk = nn.Sequential(_LoRALinear(16, 2), nn.Tanh(), _LoRALinear(16, 2)).double()
        heads = [nn.Linear(16, 1).double() for _ in range(3)]
        shared = [p for p in trunk.parameters() if p.requires_grad]
        assert len(shared) == 4
        buf = TaskGradBuffer(shared, [p for h in heads for p in h.parameters()], mode=mode,
                             **({"modules": trunk} if mode == "gramian" else {}))
        x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        feats = trunk(x)
        buf.backward([h(feats).pow(2).mean() * (k + 1) for k, h in enumerate(heads)])
        buf.apply_(make_balancer("upgrad"))
        grads[mode] = grads_of(shared)
        assert all(p.grad is None for p in trunk.parameters() if not p.requires_grad)
    _close(grads["gramian"], grads["matrix"], rtol=1e-9)
