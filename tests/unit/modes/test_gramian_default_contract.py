"""``gramian`` mode's default passes at many tasks: from ``CONTRACT_MIN_TASKS`` on, where the
loop would keep more, the step is contracted inside one batched call that starts at the trunk's
outputs (``modes/_cut.py``, ``modes/_routes.py``: ``contract_by_default``). The reference is
``matrix`` mode's loop of K ``autograd.grad`` calls (its ``[K, P]`` rows and ``wᵀG``)."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from gradbalance import TaskGradBuffer
from gradbalance.modes._blocks import Block, Call
from gradbalance.modes._cut import trunk_cut
from gradbalance.modes._routes import CONTRACT_MIN_TASKS, contract_by_default
from gradbalance_lab.models import MultiTaskModel, make_heads, regression_losses
from support.helpers import Unbatchable, build, forced_buffer, grads_of
from support.perf import make_balancer

K = CONTRACT_MIN_TASKS


def _step(buf: TaskGradBuffer, model: MultiTaskModel, x: Tensor, y: Tensor,
          name: str = "upgrad") -> tuple[list[Tensor], bool]:
    """One step; the gradients written and whether its passes were contracted."""
    buf.backward(regression_losses(model(x), y))
    recorder = getattr(buf._engine, "recorder", None)
    contracted = recorder is not None and recorder.contracted is not None
    buf.apply_(make_balancer(name))
    grads = grads_of(model.shared_parameters()) + grads_of(model.head_parameters())
    model.zero_grad(set_to_none=True)
    return grads, contracted


def _check(model: MultiTaskModel, x: Tensor, y: Tensor, name: str = "upgrad",
           rtol: float = 1e-9) -> bool:
    """The default step equals ``matrix`` mode's loop; returns whether it was contracted."""
    ref, _ = _step(forced_buffer(model, "matrix", "loop"), model, x, y, name)
    got, contracted = _step(forced_buffer(model, "gramian", "auto"), model, x, y, name)
    for a, e in zip(got, ref, strict=True):
        torch.testing.assert_close(a, e, rtol=rtol, atol=rtol * max(float(e.abs().max()), 1e-3))
    return contracted


def _block(held: int, name: str) -> Block:
    """A linear block whose one recorded call of 1 row and ``held`` outputs is kept, on the
    activations route (it holds ``K × held`` there)."""
    layer = nn.Linear(1, held, bias=False)
    block = Block(layer, name, [layer.weight], (1, held), route="activations")
    block.calls.append(Call(1, torch.zeros(1, 1), torch.zeros(1, held)))
    return block


def test_the_rule_by_hand() -> None:
    # loop: every layer's K·n·o at once; contracted: K², the trunk's output and one layer
    # (each as the largest): three layers of 64 outputs at K = 32 hold 3·2048 = 6144 against
    # 1024 + 2·2048 = 5120; two hold 4096 < 5120; below K = 32 never
    three = [_block(64, str(i)) for i in range(3)]
    assert contract_by_default(three, K)
    assert not contract_by_default(three[:2], K)
    assert not contract_by_default(three, K - 1)
    assert not contract_by_default([_block(8, str(i)) for i in range(3)], K)  # 768 < 1536
    unkept = _block(64, "3")
    unkept.calls[0].output = None  # a call the forward did not keep: no contraction for it
    assert not contract_by_default([*three[:2], unkept], K)


@pytest.mark.parametrize(("kind", "contracts"), [("mlp", True), ("transformer", True),
                                                 ("cnn", False)])
def test_the_default_at_many_tasks_equals_matrix_mode(kind: str, contracts: bool) -> None:
    # MLP and transformer: three / four recorded layers of similar size, contracted; the
    # CNN's layers take their small rows (the largest outweighs the others): the loop
    model, x, y = build(kind, num_tasks=K, batch=3, dtype=torch.float64)
    assert _check(model, x, y) is contracts


def test_few_tasks_keep_the_loop() -> None:
    model, x, y = build("mlp", num_tasks=K - 1, batch=3, dtype=torch.float64)
    assert not _check(model, x, y)


class _Mixed(nn.Module):
    """Linear layers (one called twice) around an unrecorded LayerNorm, and a last layer whose
    weight is also used outside its call."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        self.twice = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.tied = nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.twice(torch.tanh(self.twice(torch.tanh(self.first(x))))))
        h = self.norm(h)
        out: Tensor = torch.tanh(self.tied(h)) + 0.1 * nn.functional.linear(h, self.tied.weight)
        return out


def _mixed(batch: int, seed: int) -> tuple[MultiTaskModel, Tensor, Tensor]:
    torch.manual_seed(seed)
    model = MultiTaskModel(_Mixed(8), make_heads(8, K)).double()
    gen = torch.Generator().manual_seed(seed)
    return (model, torch.randn(batch, 8, generator=gen, dtype=torch.float64),
            torch.randn(batch, K, generator=gen, dtype=torch.float64))


def test_mixed_trunk_is_contracted() -> None:
    assert _check(*_mixed(3, 0), rtol=1e-8)


@settings(max_examples=5, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 6), seed=st.integers(0, 2**16),
       name=st.sampled_from(["upgrad", "mgda", "pcgrad"]))
def test_mixed_trunk_property(batch: int, seed: int, name: str) -> None:
    # whichever way the rule goes at this batch (rows or output gradients per layer), the
    # update is matrix mode's
    _check(*_mixed(batch, seed), name, rtol=1e-8)


def _mlp(k: int = K) -> tuple[MultiTaskModel, Tensor, Tensor]:
    return build("mlp", num_tasks=k, batch=3, dtype=torch.float64)


def test_a_head_using_a_trunk_weight_starts_at_the_losses() -> None:
    # the trunk's output does not cut the path from head 0 to the tied weight: the batched
    # call starts at the losses, still contracted and exact
    model, x, y = _mlp()
    last = model.trunk[4]
    head = model.heads[0]
    original = head.forward

    def tied(h: Tensor) -> Tensor:
        out: Tensor = original(h) + 0.1 * (h @ last.weight[:, :1])
        return out

    head.forward = tied  # type: ignore[method-assign]
    feats = model.trunk(x)
    loss = model.heads[0](feats).sum()
    assert trunk_cut(loss, [(feats, feats._version)], model.shared_parameters()) is None
    assert _check(model, x, y)


def test_a_cut_refused_hook_inplace_nested() -> None:
    model, x, _ = _mlp()
    params = model.shared_parameters()
    feats = model.trunk(x)
    loss = model.heads[0](feats).sum()
    assert trunk_cut(loss, [(feats, feats._version)], params) == [feats]
    inner = model.trunk[:4](x)  # one root inside another: the outer cut counted twice
    outer = model.trunk[4:](inner)
    loss2 = model.heads[0](outer).sum()
    assert trunk_cut(loss2, [(inner, inner._version), (outer, outer._version)], params) is None
    hooked = model.trunk(x)
    hooked.register_hook(lambda g: g)  # a user's hook would also see the stacks
    assert trunk_cut(model.heads[0](hooked).sum(), [(hooked, hooked._version)], params) is None
    edited = model.trunk(x)
    version = edited._version
    edited.mul_(2.0)  # modified in place after its forward
    assert trunk_cut(model.heads[0](edited).sum(), [(edited, version)], params) is None


def test_a_hook_on_the_trunk_output_starts_at_the_losses() -> None:
    # the cut refused (the hook would see the K passes and then the stacks): the batched call
    # starts at the losses, contracted and exact
    model, x, y = _mlp()
    ref, _ = _step(forced_buffer(model, "matrix", "loop"), model, x, y)
    buf = forced_buffer(model, "gramian", "auto")
    seen = []
    out = model.trunk(x)
    out.register_hook(lambda g: seen.append(g.shape))
    buf.backward(regression_losses([head(out) for head in model.heads], y))
    assert buf._engine.recorder.contracted is not None  # type: ignore[attr-defined]
    buf.apply_(make_balancer("upgrad"))
    assert seen  # the hook ran
    got = grads_of(model.shared_parameters()) + grads_of(model.head_parameters())
    for a, e in zip(got, ref, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


def test_a_hooked_parameter_keeps_the_loop() -> None:
    model, x, y = _mlp()
    calls = []
    handle = model.shared_parameters()[0].register_hook(lambda g: calls.append(1))
    try:
        assert not _check(model, x, y)
    finally:
        handle.remove()
    assert len(calls) == 2 * K  # K passes in each mode, as in the loop


class _Checkpointed(nn.Module):
    def __init__(self, trunk: nn.Module) -> None:
        super().__init__()
        self.trunk = trunk

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = checkpoint(self.trunk, x, use_reentrant=False)
        return out


def test_checkpointing_stays_exact() -> None:
    model, x, y = _mlp()
    model.trunk = _Checkpointed(model.trunk)
    _check(model, x, y)


def test_a_parameter_outside_the_lists_gets_its_plain_gradient() -> None:
    # other_params="sum": a trunk parameter in neither list gets the plain gradient of
    # sum(losses), as in the loop; the shared ones are balanced
    model, x, y = _mlp()
    extra = nn.Parameter(torch.linspace(0.5, 1.5, 32, dtype=torch.float64))
    shared, heads = model.shared_parameters(), model.head_parameters()
    model.trunk.register_parameter("extra", extra)
    forward = model.trunk.forward
    model.trunk.forward = lambda h: forward(h) * extra  # type: ignore[method-assign]
    results = []
    for mode, passes in (("matrix", "loop"), ("gramian", "auto")):
        buf = TaskGradBuffer(shared, heads, mode=mode, passes=passes,  # type: ignore[arg-type]
                             other_params="sum",
                             **({"modules": model.trunk} if mode == "gramian" else {}))
        buf.backward(regression_losses(model(x), y))
        contracted = getattr(buf._engine, "recorder", None) is not None and \
            buf._engine.recorder.contracted is not None  # type: ignore[attr-defined]
        buf.apply_(make_balancer("upgrad"))
        results.append((grads_of([*shared, *heads, extra]), contracted))
        model.zero_grad(set_to_none=True)
    (ref, _), (got, contracted) = results
    assert contracted
    for a, e in zip(got, ref, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)


def test_a_failed_batched_call_falls_back_to_the_loop_and_stays() -> None:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(6, 16), Unbatchable(), nn.Tanh(), nn.Linear(16, 16),
                          nn.Tanh(), nn.Linear(16, 16))
    model = MultiTaskModel(trunk, make_heads(16, K)).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, K, dtype=torch.float64)
    ref, _ = _step(forced_buffer(model, "matrix", "loop"), model, x, y)
    buf = forced_buffer(model, "gramian", "auto")
    for warns in (True, False):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, contracted = _step(buf, model, x, y)
        assert not contracted
        assert any("falling back to the loop" in str(w.message) for w in caught) is warns
        for a, e in zip(got, ref, strict=True):
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-12)
