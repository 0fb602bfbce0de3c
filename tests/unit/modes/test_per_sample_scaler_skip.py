"""batch_dim=0 under a ``GradScaler("cpu")``: a step the scaler skips is one ``found_inf``
reports and the step treats as skipped, whatever holds the overflow (a head alone, a sparse
head), and it runs the post-accumulate-grad hooks plain ``backward`` runs. The expected
decision is the scaler's own on plain ``scaler.scale(loss).backward()`` of the same model."""

from __future__ import annotations

import copy

import torch
from torch import nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import Sum, UPGrad


def _scaler() -> torch.amp.GradScaler:
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    return scaler


def _skipped(scaler: torch.amp.GradScaler, params: list[torch.Tensor]) -> bool:
    """Whether ``scaler.step`` skips (its scale falls)."""
    scale = scaler.get_scale()
    scaler.step(torch.optim.SGD(params, lr=0.1))
    scaler.update()
    return scaler.get_scale() < scale


def test_an_overflow_in_a_head_alone_is_a_skipped_step() -> None:
    torch.manual_seed(0)
    trunk, head = nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Linear(8, 1)
    gate = nn.Parameter(torch.tensor(1.0))  # a head whose gradient is inf: d√(c − c)/dc
    x, y = torch.randn(8, 6), torch.randn(8)
    plain = [copy.deepcopy(m) for m in (trunk, head, gate)]
    scaler = _scaler()
    losses = (plain[1](plain[0](x))[:, 0] - y) ** 2 + torch.sqrt(plain[2] - plain[2].detach())
    scaler.scale(losses.sum()).backward()
    expected = _skipped(scaler, [*plain[0].parameters(), *plain[1].parameters(), plain[2]])
    assert expected
    buf = TaskGradBuffer(list(trunk.parameters()), [*head.parameters(), gate], modules=trunk,
                         batch_dim=0, update_every=2)
    scaler = _scaler()
    losses = (head(trunk(x))[:, 0] - y) ** 2 + torch.sqrt(gate - gate.detach())
    assert bool(torch.isfinite(losses).all())
    buf.backward(losses, scaler=scaler)
    balancer = UPGrad()
    stats = buf.apply_(balancer, scaler=scaler)
    assert stats.found_inf == expected
    written = [*trunk.parameters(), *head.parameters(), gate]
    assert all(not bool(torch.isfinite(p.grad).all()) for p in written)
    assert buf.state_dict()["step"] == 0 and buf.state_dict()["weights"] is None
    assert _skipped(scaler, written) == expected


def test_a_sparse_head_on_a_skipped_step() -> None:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
    emb, lin = nn.Embedding(10, 8, sparse=True), nn.Linear(8, 1)
    heads = [emb.weight, *lin.parameters()]
    buf = TaskGradBuffer(list(trunk.parameters()), heads, modules=trunk, batch_dim=0)
    scaler = _scaler()
    x, ids, y = torch.randn(6, 6), torch.randint(0, 10, (6,)), torch.randn(6)
    f = trunk(x)
    f.register_hook(lambda g: g * torch.where(torch.arange(6)[:, None] == 0, float("inf"), 1.0))
    buf.backward((lin(f)[:, 0] + (emb(ids) * f).sum(1) - y) ** 2, scaler=scaler)
    stats = buf.apply_(Sum(), scaler=scaler)
    assert stats.found_inf and not buf.in_step
    assert emb.weight.grad is not None and emb.weight.grad.layout == torch.sparse_coo
    assert not bool(torch.isfinite(emb.weight.grad.coalesce().values()).all())
    assert _skipped(scaler, [*trunk.parameters(), *heads])


def test_a_skipped_step_runs_the_hooks_plain_backward_runs() -> None:
    torch.manual_seed(0)
    trunk0, head0 = nn.Sequential(nn.Linear(6, 8), nn.Tanh()), nn.Linear(8, 1)
    x, y = torch.randn(8, 6), torch.randn(8)
    y[0] = float("nan")  # one NaN loss: the scaler skips
    seen: dict[str, list[str]] = {}
    for route in ("plain", "per_sample"):
        trunk, head = copy.deepcopy(trunk0), copy.deepcopy(head0)
        calls = seen.setdefault(route, [])
        for name, p in [*trunk.named_parameters(prefix="trunk"),
                        *head.named_parameters(prefix="head")]:
            p.register_post_accumulate_grad_hook(lambda p, name=name, calls=calls:
                                                 calls.append(name))
        scaler = _scaler()
        buf = TaskGradBuffer(list(trunk.parameters()), list(head.parameters()),
                             modules=trunk, batch_dim=0) if route == "per_sample" else None
        losses = (head(trunk(x))[:, 0] - y) ** 2
        if buf is None:
            scaler.scale(losses.sum()).backward()
        else:
            buf.backward(losses, scaler=scaler)
            assert buf.apply_(Sum(), scaler=scaler).found_inf
    assert sorted(seen["per_sample"]) == sorted(seen["plain"]) and len(seen["plain"]) == 4
