"""Per-sample clipping (DP-SGD's clip): closed forms, a per-sample loop, noise statistics."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradbalance import NonFiniteGradientError, TaskGradBuffer, task_gradients
from gradbalance.balancers import MGDA, Sum
from gradbalance.clip import (
    GhostNorms,
    PerSampleClip,
    per_sample_grad_norms,
    per_sample_grad_norms_of_model,
)
from gradbalance_lab.models import MultiTaskModel
from support.helpers import ItemInBackward, build

# -- linear regression: every per-sample gradient in closed form ------------------------

X = torch.tensor([[1.0, 2.0, 0.0], [0.5, -1.0, 3.0], [-2.0, 0.0, 1.0], [0.1, 0.2, 0.3]],
                 dtype=torch.float64)
Y = torch.tensor([1.0, -4.0, 2.5, 0.0], dtype=torch.float64)


def _linear() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = torch.tensor([0.3, -0.7, 1.1], dtype=torch.float64, requires_grad=True)
    b = torch.tensor(0.2, dtype=torch.float64, requires_grad=True)
    return w, b, (X @ w + b - Y) ** 2


def _closed_form(max_norm: float, norm_type: float = 2.0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ℓᵢ = rᵢ², ∇w = 2 rᵢ xᵢ, ∇b = 2 rᵢ: the norms, and the clipped mean of both gradients."""
    w = torch.tensor([0.3, -0.7, 1.1], dtype=torch.float64)
    r = X @ w + 0.2 - Y
    full = torch.cat([X, torch.ones(4, 1, dtype=torch.float64)], dim=1)  # [xᵢ, 1]
    norms = 2 * r.abs() * torch.linalg.vector_norm(full, norm_type, dim=1)
    coef = torch.clamp(max_norm / (norms + 1e-6), max=1.0)
    grads = (coef * 2 * r).unsqueeze(1) * full
    mean = grads.mean(dim=0)
    return norms, mean[:3], mean[3]


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_linear_regression_matches_closed_form(norm_type: float) -> None:
    w, b, per_sample = _linear()
    clip = PerSampleClip(max_norm=3.0, norm_type=norm_type)
    loss = clip(per_sample, [w, b])
    loss.backward()
    norms, grad_w, grad_b = _closed_form(3.0, norm_type)
    assert clip.last_norms is not None
    torch.testing.assert_close(clip.last_norms, norms, rtol=1e-12, atol=0)
    assert (norms > 3.0).sum() >= 2 and (norms < 3.0).sum() >= 1  # both branches taken
    torch.testing.assert_close(w.grad, grad_w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(b.grad, grad_b, rtol=1e-12, atol=1e-14)


def test_loss_value_is_the_plain_batch_mean() -> None:
    w, b, per_sample = _linear()
    loss = PerSampleClip(max_norm=0.5)(per_sample, [w, b])
    assert loss.shape == ()
    assert torch.equal(loss.detach(), per_sample.mean().detach())


def test_large_limit_leaves_the_gradient_unclipped() -> None:
    w, b, per_sample = _linear()
    PerSampleClip(max_norm=1e9)(per_sample, [w, b]).backward()
    w2, b2, plain = _linear()
    plain.mean().backward()
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-12, atol=0)
    torch.testing.assert_close(b.grad, b2.grad, rtol=1e-12, atol=0)


# -- a multitask model against a loop over samples --------------------------------------


def _loss_fn(outputs: list[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """Per-sample squared errors ``[B, K]``."""
    return torch.stack([(out.squeeze(-1) - y[:, k]) ** 2 for k, out in enumerate(outputs)],
                       dim=1)


def _per_sample_losses(model: MultiTaskModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _loss_fn(model(x), y)


def _loop_reference(model: MultiTaskModel, x: torch.Tensor, y: torch.Tensor, max_norm: float,
                    per_task: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each sample on its own forward: norms, the [K, P_trunk] clipped rows, the full grad."""
    params = list(model.parameters())
    trunk = list(model.trunk.parameters())
    n_trunk = sum(p.numel() for p in trunk)
    batch, k_total = y.shape
    norms = torch.zeros(batch, k_total) if per_task else torch.zeros(batch)
    rows = torch.zeros(k_total, n_trunk)
    total = torch.zeros(sum(p.numel() for p in params))
    for i in range(batch):
        losses = _per_sample_losses(model, x[i : i + 1], y[i : i + 1])[0]
        grads = [torch.cat([torch.zeros_like(p).flatten() if g is None else g.flatten()
                            for p, g in zip(params, torch.autograd.grad(
                                losses[k], params, retain_graph=True, allow_unused=True))])
                 for k in range(k_total)]
        per_task_grads = torch.stack(grads)  # [K, P]
        if per_task:
            norms[i] = per_task_grads.norm(dim=1)
            coef = torch.clamp(max_norm / (norms[i] + 1e-6), max=1.0)
        else:
            norms[i] = per_task_grads.sum(0).norm()
            coef = torch.clamp(max_norm / (norms[i] + 1e-6), max=1.0).expand(k_total)
        clipped = coef.unsqueeze(1) * per_task_grads / batch
        rows += clipped[:, :n_trunk]
        total += clipped.sum(0)
    return norms, rows, total


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("per_task", [True, False])
def test_task_rows_and_update_match_a_per_sample_loop(kind: str, per_task: bool) -> None:
    model, x, y = build(kind, num_tasks=3, batch=6)
    params = list(model.parameters())
    trunk = list(model.trunk.parameters())
    norms, _, _ = _loop_reference(model, x, y, max_norm=1.0, per_task=per_task)
    limit = float(norms.median())  # some samples clipped, some not
    norms, rows, total = _loop_reference(model, x, y, max_norm=limit, per_task=per_task)

    clip = PerSampleClip(max_norm=limit, per_task=per_task)
    losses = clip(_per_sample_losses(model, x, y), params)
    assert clip.last_norms is not None
    torch.testing.assert_close(clip.last_norms, norms, rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(task_gradients(losses, trunk, retain_graph=True), rows,
                               rtol=1e-4, atol=1e-7)
    buf = TaskGradBuffer(trunk, model.head_parameters())
    buf.backward(losses)
    buf.apply_(Sum())
    update = torch.cat([p.grad.flatten() for p in params])
    torch.testing.assert_close(update, total, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("per_task", [True, False])
def test_norms_from_the_model_match_a_per_sample_loop(kind: str, per_task: bool) -> None:
    model, x, y = build(kind, num_tasks=3, batch=6)
    norms, _, _ = _loop_reference(model, x, y, max_norm=1.0, per_task=per_task)
    for chunk_size in (None, 4):
        found = per_sample_grad_norms_of_model(model, _loss_fn, x, y, per_task=per_task,
                                               chunk_size=chunk_size)
        torch.testing.assert_close(found, norms, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())


def test_losses_of_model_give_the_same_update_as_the_graph_route() -> None:
    model, x, y = build("mlp", num_tasks=3, batch=8)
    trunk = list(model.trunk.parameters())
    clip = PerSampleClip(max_norm=5.0)
    from_model = clip.losses_of_model(model, _loss_fn, x, y)
    rows_model = task_gradients(from_model, trunk)
    norms_model = clip.last_norms
    from_graph = clip(_per_sample_losses(model, x, y), model.parameters())
    torch.testing.assert_close(clip.last_norms, norms_model, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(rows_model, task_gradients(from_graph, trunk), rtol=1e-5,
                               atol=1e-7)
    assert bool((norms_model > 5.0).any()) and bool((norms_model < 5.0).any())


def test_norms_over_a_subset_of_parameters() -> None:
    model, x, y = build("mlp", num_tasks=2, batch=4)
    heads = model.head_parameters()
    found = per_sample_grad_norms_of_model(model, _loss_fn, x, y, params=heads)
    expected = per_sample_grad_norms(_per_sample_losses(model, x, y), heads)
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="not trainable parameters of the module"):
        per_sample_grad_norms_of_model(model, _loss_fn, x, y, params=[torch.zeros(2)])
    with pytest.raises(ValueError, match=r"same first \(batch\) dimension"):
        per_sample_grad_norms_of_model(model, _loss_fn, x, y[:3])
    with pytest.raises(ValueError, match=r"norms must have shape \(4, 2\)"):
        PerSampleClip(1.0)(_per_sample_losses(model, x, y), heads, norms=torch.ones(4))


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("per_task", [True, False])
def test_ghost_norms_match_a_per_sample_loop(kind: str, per_task: bool) -> None:
    model, x, y = build(kind, num_tasks=3, batch=6)
    norms, _, _ = _loop_reference(model, x, y, max_norm=1.0, per_task=per_task)
    limit = float(norms.median())
    _, rows, _ = _loop_reference(model, x, y, max_norm=limit, per_task=per_task)
    ghost = GhostNorms(model, per_task=per_task)
    per_sample = _per_sample_losses(model, x, y)
    found = ghost.norms(per_sample)
    torch.testing.assert_close(found, norms, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for p in model.parameters())
    # through the clip: the same rows as the loop
    clip = PerSampleClip(max_norm=limit, per_task=per_task)
    per_sample = _per_sample_losses(model, x, y)
    losses = clip(per_sample, model.parameters(), norms=ghost.norms(per_sample))
    torch.testing.assert_close(task_gradients(losses, list(model.trunk.parameters())), rows,
                               rtol=1e-4, atol=1e-7)


def _single_sample_norms(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                         norm_type: float = 2.0) -> torch.Tensor:
    """``‖∇θ (f(xᵢ) − yᵢ)ₖ²‖ₚ`` ``[B, K]``, each sample through the model on its own."""
    params = list(model.parameters())
    rows = []
    for i in range(x.shape[0]):
        ell = ((model(x[i : i + 1]) - y[i]) ** 2)[0]
        rows.append(torch.stack([torch.linalg.vector_norm(torch.cat([
            g.flatten() for g in torch.autograd.grad(ell[k], params, retain_graph=True)]),
            norm_type) for k in range(ell.shape[0])]))
    return torch.stack(rows)


def _check_ghost_against_single_samples(model: torch.nn.Module, x: torch.Tensor,
                                        y: torch.Tensor, norm_type: float = 2.0) -> GhostNorms:
    """Assert ghost norms of ``(f(x) − y)²`` equal the single-sample loop's; return the hooks."""
    expected = _single_sample_norms(model, x, y, norm_type)
    ghost = GhostNorms(model, norm_type=norm_type)
    torch.testing.assert_close(ghost.norms((model(x) - y) ** 2), expected, rtol=1e-10,
                               atol=1e-12)
    return ghost


class _TokenMLP(torch.nn.Module):
    """Linear layers on ``[B, S, d]`` tokens (called twice: a shared layer), mean-pooled."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d, hidden)
        self.shared = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(torch.tanh(self.shared(torch.tanh(self.inp(x))))))
        return self.out(h).mean(dim=1)  # [B, 2]


@pytest.mark.parametrize(("seq", "d", "hidden", "norm_type"), [
    (3, 8, 16, 2.0),    # S² (i + o) < S·i·o: the Gram form
    (12, 2, 3, 2.0),    # the materialised form
    (3, 8, 16, 1.0),    # p = 1 always materialises
])
def test_ghost_norms_on_token_inputs_and_a_reused_layer(seq: int, d: int, hidden: int,
                                                          norm_type: float) -> None:
    torch.manual_seed(0)
    model = _TokenMLP(d, hidden).double()
    x = torch.randn(5, seq, d, dtype=torch.float64)
    y = torch.randn(5, 2, dtype=torch.float64)
    _check_ghost_against_single_samples(model, x, y, norm_type)


def test_ghost_norms_of_strided_dilated_rectangular_convolutions() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 5, (3, 2), stride=(2, 1), dilation=(1, 2), padding=(1, 2)),
        torch.nn.Tanh(), torch.nn.Conv2d(5, 4, 2, stride=2, bias=False), torch.nn.Flatten(),
        torch.nn.LazyLinear(2),
    ).double()
    x = torch.randn(4, 3, 9, 8, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    model(x)  # materialise the lazy layer
    _check_ghost_against_single_samples(model, x, y)


class _NormedTokens(torch.nn.Module):
    """Linear, LayerNorm over the last two axes, tanh, Linear on ``[B, S, 2, 3]`` tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(3, 3)
        self.norm = torch.nn.LayerNorm((2, 3))
        self.out = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))  # [B, S, 2, 3]
        return self.out(h.flatten(2)).mean(dim=1)


def test_ghost_norms_of_layer_norm() -> None:
    torch.manual_seed(2)
    model = _NormedTokens().double()
    with torch.no_grad():  # affine parameters away from their (1, 0) start
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(4, 5, 2, 3, dtype=torch.float64)
    y = torch.randn(4, 2, dtype=torch.float64)
    _check_ghost_against_single_samples(model, x, y)


class _Tokens(torch.nn.Module):
    """``[B, S, i]`` -> Linear -> tanh -> Linear -> mean over S: ``[B, K]`` outputs."""

    def __init__(self, i: int, h: int, k: int) -> None:
        super().__init__()
        self.first = torch.nn.Linear(i, h)
        self.second = torch.nn.Linear(h, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x))).mean(dim=1)


@settings(max_examples=25, deadline=None)
@given(batch=st.integers(1, 5), seq=st.integers(1, 6), i=st.integers(1, 7),
       h=st.integers(1, 7), k=st.integers(1, 3), seed=st.integers(0, 2**16),
       p=st.sampled_from([1.0, 2.0, 3.0]))
def test_ghost_norms_equal_the_torch_func_route(batch: int, seq: int, i: int, h: int, k: int,
                                                seed: int, p: float) -> None:
    # Two independent computations: layer algebra on recorded activations, and vmap over
    # single-sample gradients.
    torch.manual_seed(seed)
    model = _Tokens(i, h, k).double()
    x = torch.randn(batch, seq, i, dtype=torch.float64)
    y = torch.randn(batch, k, dtype=torch.float64)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target) ** 2  # [B, K]

    expected = per_sample_grad_norms_of_model(model, loss_fn, x, y, norm_type=p)
    ghost = GhostNorms(model, norm_type=p)
    found = ghost.norms(loss_fn(model(x), y))
    torch.testing.assert_close(found.reshape(expected.shape), expected, rtol=1e-9, atol=1e-12)


def test_ghost_norms_of_a_strided_dilated_1d_convolution() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Conv1d(3, 4, 3, stride=2, dilation=2, padding=3), torch.nn.Tanh(),
        torch.nn.Conv1d(4, 2, 2), torch.nn.AdaptiveAvgPool1d(1), torch.nn.Flatten(),
    ).double()
    x = torch.randn(5, 3, 11, dtype=torch.float64)
    y = torch.randn(5, 2, dtype=torch.float64)
    _check_ghost_against_single_samples(model, x, y)


class _EmbeddedTokens(torch.nn.Module):
    """Token ids ``[B, S]`` -> Embedding (padding id 0) -> LayerNorm -> tanh -> Linear, with
    the embedding called twice (a tied input): mean over S, ``[B, 2]`` outputs."""

    def __init__(self, vocab: int, d: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d, padding_idx=0)
        self.norm = torch.nn.LayerNorm(d)
        self.out = torch.nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + 0.5 * self.embed(ids.flip(1))
        return self.out(torch.tanh(self.norm(h))).mean(dim=1)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0])
def test_ghost_norms_of_an_embedding_with_repeated_and_padding_ids(norm_type: float) -> None:
    # A vocabulary of 5 over 9 positions: ids repeat within a sample (their rows add up
    # before the norm) and id 0 is padding (its row gets no gradient).
    torch.manual_seed(3)
    model = _EmbeddedTokens(vocab=5, d=4).double()
    ids = torch.randint(0, 5, (6, 9))
    ids[0] = 0  # one sample all padding: only LayerNorm and the head have gradients
    y = torch.randn(6, 2, dtype=torch.float64)
    ghost = _check_ghost_against_single_samples(model, ids, y, norm_type)
    embedding_only = GhostNorms(model, params=[model.embed.weight], norm_type=norm_type)
    found = embedding_only.norms((model(ids) - y) ** 2)
    ghost.clear()
    assert (found[0] == 0).all() and (found[1:] > 0).all()


def test_ghost_norms_refuse_an_embedding_scaled_by_frequency() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 3, scale_grad_by_freq=True),
                                torch.nn.Flatten(), torch.nn.Linear(6, 1))
    with pytest.raises(ValueError, match=r"0 \(scale_grad_by_freq couples the samples\)"):
        GhostNorms(model)


@pytest.mark.parametrize("materialise", [False, True])
def test_ghost_norms_under_bfloat16_autocast(materialise: bool) -> None:
    # 16-bit layer outputs (and output gradients), fp32 inputs: both routes run in fp32 and
    # stay within bfloat16's own rounding of the fp32 norms.
    model, x, y = build("mlp", num_tasks=2, batch=6)
    reference = GhostNorms(model, norm_type=1.0 if materialise else 2.0)
    expected = reference.norms(_per_sample_losses(model, x, y))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        per_sample = _loss_fn([o.float() for o in model(x)], y)
    found = reference.norms(per_sample)
    assert found.dtype == torch.float32
    torch.testing.assert_close(found, expected, rtol=3e-2, atol=1e-4)


def test_ghost_norms_refuse_what_they_cannot_bound() -> None:
    model, x, y = build("transformer", num_tasks=2, batch=4)
    with pytest.raises(ValueError, match=r"covers the weights and biases of nn.Linear, "
                                         r"nn.Conv1d, nn.Conv2d .groups=1, zero padding., "
                                         r"nn.LayerNorm and nn.Embedding; \[.*in_proj"):
        GhostNorms(model)
    grouped = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, groups=2), torch.nn.Flatten())
    with pytest.raises(ValueError, match=r"refused layers: 0 \(grouped convolution\)"):
        GhostNorms(grouped)
    mlp, x, y = build("mlp", num_tasks=2, batch=4)
    with pytest.raises(ValueError, match="Invalid norm_type: inf"):
        GhostNorms(mlp, norm_type=math.inf)
    ghost = GhostNorms(mlp, params=mlp.head_parameters())
    with torch.no_grad():
        mlp(x)  # not recorded
    with pytest.raises(RuntimeError, match="no forward under grad was recorded"):
        ghost.norms(torch.ones(4, 2, requires_grad=True))
    mlp(x[:2])  # a stray forward since the last norms(), off the losses' graph: dropped
    with pytest.raises(ValueError, match=r"recorded inputs of shapes \[\(4, 32\)\] but the "
                                         r"losses have 2 samples"):
        ghost.norms(_per_sample_losses(mlp, x, y)[:2])
    mlp(x[:3])
    found = ghost.norms(_per_sample_losses(mlp, x, y))
    expected = per_sample_grad_norms(_per_sample_losses(mlp, x, y), mlp.head_parameters())
    ghost.clear()
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-7)
    with pytest.warns(RuntimeWarning, match=r"holds 64 forwards of layer 'heads\.[01]'"):
        for _ in range(64):
            mlp(x)  # e.g. an evaluation loop under grad: the records pile up
    ghost.remove()
    assert all(not layer.outputs for layer in ghost._layers)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, None])
def test_chunking_gives_the_same_norms(chunk_size: int | None) -> None:
    model, x, y = build("mlp", num_tasks=3, batch=6)
    norms, _, _ = _loop_reference(model, x, y, max_norm=1.0, per_task=True)
    found = per_sample_grad_norms(_per_sample_losses(model, x, y), model.parameters(),
                                  chunk_size=chunk_size)
    torch.testing.assert_close(found, norms, rtol=1e-4, atol=1e-7)


def test_two_micro_batches_equal_the_full_batch() -> None:
    # Per-sample clipping does not depend on which samples share a batch (no BatchNorm).
    def run(splits: int) -> list[torch.Tensor]:
        model, x, y = build("mlp", num_tasks=3, batch=8)
        clip = PerSampleClip(max_norm=5.0)
        buf = TaskGradBuffer(model.trunk.parameters(), model.head_parameters())
        for xs, ys in zip(x.chunk(splits), y.chunk(splits)):
            buf.backward(clip(_per_sample_losses(model, xs, ys), model.parameters()) / splits)
        buf.apply_(MGDA())
        return [p.grad.clone() for p in model.parameters()]

    for a, b in zip(run(2), run(1)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_model_without_batching_rule_falls_back_to_a_loop() -> None:
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    x = torch.tensor([[1.0, 0.0], [0.0, 3.0], [2.0, 2.0]])
    per_sample = (x @ ItemInBackward.apply(w)) ** 2  # ℓᵢ = (2 xᵢ·w)², ∇ = 8 (xᵢ·w) xᵢ
    with pytest.warns(RuntimeWarning, match="falling back"):
        norms = per_sample_grad_norms(per_sample, [w])
    dots = x @ w.detach()
    torch.testing.assert_close(norms, 8 * dots.abs() * x.norm(dim=1))



def test_a_hooks_own_error_raises_not_the_loop() -> None:
    """A hook of the model that raises once raises under plain backward; the batched
    per-sample backward raises it too (no fallback warning), not the loop in its place, where
    it would not raise again; called again, the norms are the closed form's."""
    w = torch.tensor([1.0, -2.0], requires_grad=True)
    x = torch.tensor([[1.0, 0.0], [0.0, 3.0], [2.0, 2.0]])
    calls = []

    def check(grad: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: the model's own check failed")

    def losses() -> torch.Tensor:
        v = w * 1.0
        v.register_hook(check)
        return (x @ v) ** 2  # ℓᵢ = (xᵢ·w)², ∇ = 2 (xᵢ·w) xᵢ

    with pytest.raises(RuntimeError, match="injected"):
        losses().sum().backward()
    calls.clear()
    w.grad = None
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(RuntimeError, match=r"^injected: the model's own check failed$"):
            per_sample_grad_norms(losses(), [w])
        norms = per_sample_grad_norms(losses(), [w])
    assert w.grad is None
    torch.testing.assert_close(norms, 2 * (x @ w.detach()).abs() * x.norm(dim=1))

# -- mixed precision and non-finite gradients -------------------------------------------


def test_scaler_gives_the_unscaled_norms() -> None:
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    assert scaler.is_enabled()
    w, b, per_sample = _linear()
    clip = PerSampleClip(max_norm=3.0)
    clip(per_sample, [w, b], scaler=scaler)
    norms, _, _ = _closed_form(3.0)
    assert clip.last_norms is not None
    torch.testing.assert_close(clip.last_norms, norms, rtol=1e-12, atol=0)


def test_overflow_without_scaler_raises_and_with_scaler_reaches_the_grad() -> None:
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    x = torch.tensor([[1.0, 1.0], [math.inf, 0.0]])
    with pytest.raises(NonFiniteGradientError, match="per-sample gradients hold inf"):
        PerSampleClip(max_norm=1.0)(((x @ w) ** 2), [w])
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    opt = torch.optim.SGD([w], lr=0.1)
    loss = PerSampleClip(max_norm=1.0)((x @ w) ** 2, [w], scaler=scaler)
    scaler.scale(loss).backward()
    before = w.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert torch.equal(w.detach(), before)  # the scaler skipped the step
    assert scaler.get_scale() < 2.0**16


# -- DP-SGD noise -----------------------------------------------------------------------


def test_noise_has_the_dp_sgd_standard_deviation() -> None:
    p = torch.zeros(200, 200, requires_grad=True)
    p.grad = torch.zeros_like(p)
    clip = PerSampleClip(max_norm=0.5, noise_multiplier=2.0,
                         generator=torch.Generator().manual_seed(1))
    assert clip.add_noise_([p], batch_size=4)
    std = 2.0 * 0.5 / 4  # σ·C/B
    n = p.numel()
    assert abs(p.grad.mean().item()) < 4 * std / math.sqrt(n)
    assert abs(p.grad.std().item() / std - 1) < 4 / math.sqrt(2 * n)


def test_noise_resumes_bit_identically_and_skips_nonfinite_steps() -> None:
    p = torch.zeros(50, requires_grad=True)
    clip = PerSampleClip(max_norm=1.0, noise_multiplier=1.0,
                         generator=torch.Generator().manual_seed(3))
    p.grad = torch.zeros(50)
    clip.add_noise_([p], batch_size=2)
    state = clip.state_dict()
    p.grad = torch.zeros(50)
    clip.add_noise_([p], batch_size=2)
    expected = p.grad.clone()

    fresh = PerSampleClip(max_norm=1.0, noise_multiplier=1.0,
                          generator=torch.Generator().manual_seed(99))
    fresh.load_state_dict(state)
    p.grad = torch.full((50,), math.nan)
    assert not fresh.add_noise_([p], batch_size=2)  # a skipped step: nothing drawn
    assert torch.equal(fresh.generator.get_state(), state["generator"])
    p.grad = torch.zeros(50)
    fresh.add_noise_([p], batch_size=2)
    assert torch.equal(p.grad, expected)


def test_zero_noise_multiplier_adds_nothing() -> None:
    p = torch.ones(3, requires_grad=True)
    p.grad = torch.ones(3)
    assert not PerSampleClip(max_norm=1.0).add_noise_([p], batch_size=1)
    assert torch.equal(p.grad, torch.ones(3))


# -- bad input ----------------------------------------------------------------------------


def test_rejects_a_reduced_or_detached_loss() -> None:
    w, b, per_sample = _linear()
    clip = PerSampleClip(max_norm=1.0)
    with pytest.raises(ValueError, match=r"got \(\); compute the loss with reduction='none'"):
        clip(per_sample.mean(), [w, b])
    with pytest.raises(ValueError, match="does not require grad"):
        clip(per_sample.detach(), [w, b])
    with pytest.raises(ValueError, match=r"got \(2, 2, 1\)"):
        clip(per_sample[:4].view(2, 2, 1), [w, b])


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_norm": 0.0}, "Invalid max_norm: 0.0"),
    ({"max_norm": 1.0, "noise_multiplier": -1.0}, "Invalid noise_multiplier: -1.0"),
    ({"max_norm": 1.0, "chunk_size": 0}, "Invalid chunk_size: 0"),
    ({"max_norm": 1.0, "per_task": "yes"}, "Invalid per_task: 'yes'"),
    ({"max_norm": 1.0, "norm_type": 0.5}, "Invalid norm_type: 0.5"),
    ({"max_norm": 1.0, "generator": 3}, "Invalid generator: int"),
])
def test_rejects_bad_settings(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PerSampleClip(**kwargs)


def test_every_route_rejects_a_non_boolean_per_task() -> None:
    model, x, y = build("mlp", num_tasks=2, batch=4)
    per_sample = _per_sample_losses(model, x, y)
    for call in (lambda: per_sample_grad_norms(per_sample, model.parameters(), per_task=1),
                 lambda: per_sample_grad_norms_of_model(model, _loss_fn, x, y, per_task="no"),
                 lambda: GhostNorms(model, per_task=0)):
        with pytest.raises(ValueError, match="Invalid per_task"):
            call()


def test_rejects_bad_batch_size_and_foreign_state() -> None:
    clip = PerSampleClip(max_norm=1.0, noise_multiplier=1.0)
    p = torch.zeros(2, requires_grad=True)
    p.grad = torch.zeros(2)
    with pytest.raises(ValueError, match="Invalid batch_size: 0"):
        clip.add_noise_([p], batch_size=0)
    with pytest.raises(ValueError, match=r"unexpected keys \['beta'\]"):
        clip.load_state_dict({"beta": 0.1})
