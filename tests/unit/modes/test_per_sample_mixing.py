"""``batch_dim=0`` refuses a trunk whose plain tensor operations mix the samples.

A per-sample gradient exists only when sample i's loss depends on no other sample's rows after
a layer; modules such as BatchNorm are refused by name, but ``x − x.mean(0)`` or a softmax over
the batch are not modules. The expected verdict comes from the construction (an operation
across dim 0 inserted or not); where the buffer accepts a trunk, its update must equal the
matrix route's over the same objectives (each sample a task of its own).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from gradbalance import TaskGradBuffer, _per_sample_buffer
from gradbalance.balancers import MGDA

MIXERS = {
    "centre": lambda h: h - h.mean(0, keepdim=True),
    "batch_softmax": lambda h: torch.softmax(h, dim=0),
    "batch_norm_by_hand": lambda h: h / h.norm(dim=0, keepdim=True),
    "cumulative": lambda h: h.cumsum(0),
    "attention_across_samples": lambda h: torch.softmax(h @ h.T, dim=1) @ h,
}
#: Operations within each sample: the buffer must accept them.
KEEPERS = {
    "feature_softmax": lambda h: torch.softmax(h, dim=1),
    "feature_centre": lambda h: h - h.mean(1, keepdim=True),
    "dropout": nn.functional.dropout,
    "identity": lambda h: h,
}


class Trunk(nn.Module):
    def __init__(self, op: object) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(5, 6), nn.Linear(6, 4)
        self.op = op

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.op(self.first(x))))  # type: ignore[operator]


def _flat_grads(params: list[nn.Parameter]) -> Tensor:
    return torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                      for p in params])


@settings(max_examples=30, deadline=None)
@given(op=st.sampled_from(sorted({**MIXERS, **KEEPERS})), batch=st.integers(2, 9),
       tasks=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_refused_exactly_when_an_operation_mixes_the_samples(op: str, batch: int, tasks: int,
                                                             seed: int) -> None:
    torch.manual_seed(seed)
    trunk = Trunk({**MIXERS, **KEEPERS}[op])
    heads = nn.Linear(4, tasks)
    x, y = torch.randn(batch, 5), torch.randn(batch, tasks)
    params = [*trunk.parameters(), *heads.parameters()]
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), modules=trunk, batch_dim=0)
    state = torch.random.get_rng_state()
    losses = (heads(trunk(x)) - y).square()
    losses = losses[:, 0] if tasks == 1 else losses
    if op in MIXERS:
        with pytest.raises(ValueError, match=r"mixes the samples of the batch after layer\(s\) "
                                             r"\['first'\].*batch_dim=None"):
            buf.backward(losses)
        assert all(p.grad is None for p in params)  # nothing moved
        return
    buf.backward(losses)
    buf.apply_(MGDA())
    got = _flat_grads(params)
    # The matrix route over the same objectives, from the same forward (dropout's mask too).
    for p in params:
        p.grad = None
    torch.random.set_rng_state(state)
    reference = TaskGradBuffer(trunk.parameters(), heads.parameters())
    again = (heads(trunk(x)) - y).square()
    reference.backward(again.reshape(-1))
    reference.apply_(MGDA())
    torch.testing.assert_close(got, _flat_grads(params), rtol=1e-4, atol=1e-6)


def test_checked_once_per_structure_and_a_refusal_leaves_the_buffer_usable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three steps of one structure run the check once; a step whose layers are called
    otherwise (each twice) is checked again. After a refusal the records are dropped, and a
    forward without the mixing steps normally (its structure checked anew)."""
    calls: list[int] = []
    check = _per_sample_buffer.mixed_outputs

    def counted(*args: object) -> object:
        calls.append(1)
        return check(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(_per_sample_buffer, "mixed_outputs", counted)
    torch.manual_seed(0)
    mixing = {"on": False}
    trunk = Trunk(lambda h: h - h.mean(0, keepdim=True) if mixing["on"] else h)
    buf = TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=0)
    for _ in range(3):
        buf.backward(trunk(torch.randn(4, 5)).sum(1))
        buf.apply_(MGDA())
    assert len(calls) == 1
    buf.backward(trunk.second(torch.tanh(trunk.first(trunk.first.weight.new_ones(4, 5)))
                              ).sum(1) + trunk(torch.randn(4, 5)).sum(1))
    buf.apply_(MGDA())
    assert len(calls) == 2  # the first and second layers called twice: a new structure
    mixing["on"] = True
    fresh = TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=0)
    trunk.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="mixes the samples"):
        fresh.backward(trunk(torch.randn(4, 5)).sum(1))
    assert all(p.grad is None for p in trunk.parameters())
    mixing["on"] = False
    fresh.backward(trunk(torch.randn(4, 5)).sum(1))
    fresh.apply_(MGDA())
    assert all(p.grad is not None for p in trunk.parameters())
    assert len(calls) == 4


@pytest.mark.parametrize("op", sorted(MIXERS))
def test_ghost_norms_refuse_the_same_trunks(op: str) -> None:
    """``GhostNorms`` rests on the same identity: a mixing trunk is refused, its records
    dropped; the same trunk without the mixing gives the norms of per-sample
    ``autograd.grad`` (each sample's loss alone: the independent reference)."""
    from gradbalance.clip import GhostNorms

    torch.manual_seed(1)
    trunk = Trunk(MIXERS[op])
    ghost = GhostNorms(trunk)
    x = torch.randn(5, 5)
    with pytest.raises(ValueError, match=r"mixes the samples.*per_sample_grad_norms_of_model"):
        ghost.norms(trunk(x).square().sum(1))
    trunk.op = KEEPERS["identity"]
    losses = trunk(x).square().sum(1)
    norms = ghost.norms(losses)
    expected = torch.stack([
        torch.cat([g.flatten() for g in torch.autograd.grad(losses[i], list(trunk.parameters()),
                                                            retain_graph=True)]).norm()
        for i in range(5)])
    torch.testing.assert_close(norms, expected, rtol=1e-4, atol=1e-6)
