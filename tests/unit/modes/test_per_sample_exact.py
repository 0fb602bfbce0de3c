"""``batch_dim=0`` equals the matrix route over the same objectives (docs/per_sample.md).

The reference is a second implementation: ``TaskGradBuffer`` without ``batch_dim``, each
sample's loss (or each sample × task loss) passed as a task of its own (K = B or B·K rows,
one backward each). The per-sample Gramian is also checked against B separate
``autograd.grad`` calls.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance._per_sample_gramian import PerSampleGramian
from gradbalance.balancers import BALANCERS as BALANCERS_ALL
from gradbalance.balancers import IMTLG, MGDA, Balancer, Mean, NashMTL, UPGrad

from .per_sample_models import TRUNKS

BALANCERS: dict[str, Callable[[], Balancer]] = {
    "mgda": MGDA, "upgrad": UPGrad, "imtlg": IMTLG, "nashmtl": NashMTL, "mean": Mean,
}


def _grads(params: list[Tensor]) -> Tensor:
    return torch.cat([torch.zeros_like(p).flatten() if p.grad is None else p.grad.flatten()
                      for p in params])


def _update(trunk: nn.Module, heads: nn.Module, x: Tensor, y: Tensor, balancer: Balancer,
            per_sample: bool) -> tuple[Tensor, Tensor]:
    params = [*trunk.parameters(), *heads.parameters()]
    for p in params:
        p.grad = None
    kwargs = {"modules": trunk, "batch_dim": 0} if per_sample else {}
    buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)  # type: ignore[arg-type]
    losses = (heads(trunk(x)) - y) ** 2  # [B, K]
    losses = losses[:, 0] if y.shape[1] == 1 else losses
    buf.backward(losses if per_sample else losses.reshape(-1))
    stats = buf.apply_(balancer)
    if per_sample:
        assert buf._per_sample is not None
        buf._per_sample.gramian.remove()
    assert stats.weights is not None
    return _grads(params), stats.weights


def _compare(name: str, balancer: str, batch: int, tasks: int, seed: int,
             dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        torch.set_default_dtype(dtype)
        try:
            trunk, inputs = TRUNKS[name]()
            heads = nn.Linear(8, tasks)
            x, y = inputs(batch), torch.randn(batch, tasks)
            got, w_got = _update(trunk, heads, x, y, BALANCERS[balancer](), True)
            want, w_want = _update(trunk, heads, x, y, BALANCERS[balancer](), False)
        finally:
            torch.set_default_dtype(torch.float32)
    assert torch.allclose(w_got.double(), w_want.double(), rtol=1e-3 if dtype == torch.float32
                          else 1e-7, atol=1e-6 if dtype == torch.float32 else 1e-10)
    return got, want


@pytest.mark.parametrize("name", sorted(TRUNKS))
@pytest.mark.parametrize("balancer", sorted(BALANCERS))
@pytest.mark.parametrize(("batch", "seed"), [(3, 0), (8, 1)])
def test_float64_update_equals_matrix_route(name: str, balancer: str, batch: int,
                                            seed: int) -> None:
    got, want = _compare(name, balancer, batch, 1, seed, torch.float64)
    assert torch.allclose(got, want, rtol=1e-8, atol=1e-10 * want.abs().max())


@pytest.mark.parametrize("name", sorted(TRUNKS))
@pytest.mark.parametrize("balancer", ["mgda", "upgrad", "mean"])
def test_float32_update_equals_matrix_route(name: str, balancer: str) -> None:
    got, want = _compare(name, balancer, 6, 1, 2, torch.float32)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max())


@pytest.mark.parametrize("name", ["mlp", "cnn", "mixed"])
@pytest.mark.parametrize("balancer", ["mgda", "upgrad", "imtlg"])
def test_sample_by_task_losses_equal_matrix_route(name: str, balancer: str) -> None:
    got, want = _compare(name, balancer, 4, 3, 3, torch.float64)
    assert torch.allclose(got, want, rtol=1e-8, atol=1e-10 * want.abs().max())


@pytest.mark.parametrize("name", sorted(TRUNKS))
def test_gramian_equals_per_sample_autograd(name: str) -> None:
    torch.manual_seed(4)
    torch.set_default_dtype(torch.float64)
    try:
        trunk, inputs = TRUNKS[name]()
        params = list(trunk.parameters())
        engine = PerSampleGramian(trunk, params)
        losses = trunk(inputs(5)).pow(2).sum(1)  # [B]
        outputs = engine.outputs()
        grads = torch.autograd.grad(losses.sum(), outputs, retain_graph=True)
        gram = engine.compute(5, [grads])
        engine.remove()
        rows = torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
            losses[i], params, retain_graph=True)]) for i in range(5)])
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(gram, rows @ rows.T, rtol=1e-10, atol=1e-12)


def _weighted(name: str) -> Balancer:
    if name == "constant":
        return BALANCERS_ALL[name](torch.linspace(0.5, 1.5, 6).tolist())
    return BALANCERS_ALL[name]()


def _two_steps(name: str, per_sample: bool) -> Tensor:
    """Two steps (stateful balancers carry state between them) on the MLP, B = 6."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        trunk, inputs = TRUNKS["mlp"]()
        heads = nn.Linear(8, 1)
        x, y = inputs(6), torch.randn(6, 1)
        torch.manual_seed(1)  # a balancer's private generator: the same seed on both routes
        balancer = _weighted(name)
        kwargs = {"modules": trunk, "batch_dim": 0} if per_sample else {}
        buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)  # type: ignore[arg-type]
        params = [*trunk.parameters(), *heads.parameters()]
        updates = []
        for _ in range(2):
            for p in params:
                p.grad = None
            losses = (heads(trunk(x))[:, 0] - y[:, 0]) ** 2 + 0.1
            buf.backward(losses)
            buf.apply_(balancer)
            updates.append(_grads(params))
    return torch.cat(updates)


@pytest.mark.parametrize("name", sorted(n for n, c in BALANCERS_ALL.items() if c.from_gramian))
def test_every_weighted_balancer_equals_matrix_route(name: str) -> None:
    torch.set_default_dtype(torch.float64)
    try:
        got, want = _two_steps(name, True), _two_steps(name, False)
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(got, want, rtol=1e-8, atol=1e-10 * want.abs().max())


@pytest.mark.parametrize("name", ["mlp", "tokens", "mixed", "attention"])
def test_micro_batches_form_one_gramian(name: str) -> None:
    """Two micro-batches (3 and 5 samples; sequences of 4 and 6 tokens for ``tokens``) give
    the matrix route's update over all 8 objectives at once, cross terms included."""
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(5)
        trunk, inputs = TRUNKS[name]()
        heads = nn.Linear(8, 1)
        xs = ([torch.randint(0, 11, (3, 4)), torch.randint(0, 11, (5, 6))]
              if name == "tokens" else [inputs(3), inputs(5)])
        ys = [torch.randn(3), torch.randn(5)]
        params = [*trunk.parameters(), *heads.parameters()]
        updates, weights = [], []
        for per_sample in (True, False):
            for p in params:
                p.grad = None
            kwargs = {"modules": trunk, "batch_dim": 0} if per_sample else {}
            buf = TaskGradBuffer(trunk.parameters(), heads.parameters(), **kwargs)  # type: ignore[arg-type]
            if per_sample:  # each micro-batch's forward, then its backward
                for x, y in zip(xs, ys):
                    buf.backward((heads(trunk(x))[:, 0] - y) ** 2)
            else:
                buf.backward(torch.cat([(heads(trunk(x))[:, 0] - y) ** 2
                                        for x, y in zip(xs, ys)]))
            stats = buf.apply_(UPGrad())
            assert stats.weights is not None and stats.weights.shape == (8,)
            updates.append(_grads(params))
            weights.append(stats.weights)
            if per_sample:
                assert buf._per_sample is not None and stats.num_backward == 2
                buf._per_sample.gramian.remove()
    finally:
        torch.set_default_dtype(torch.float32)
    assert torch.allclose(weights[0], weights[1], rtol=1e-7, atol=1e-10)
    assert torch.allclose(updates[0], updates[1], rtol=1e-8, atol=1e-10 * updates[1].abs().max())


@pytest.mark.parametrize("update_every", [1, 2])
def test_a_parameter_no_loss_reaches_keeps_its_grad_as_plain_backward_does(
        update_every: int) -> None:
    """A trunk parameter off the losses' graph: a plain ``sum(losses).backward()`` leaves its
    ``.grad`` alone (None stays None, so Adam and weight decay skip it), and so does the step,
    on a refresh and on a step reusing the weights."""
    torch.manual_seed(0)
    used, unused, noted = nn.Linear(4, 3), nn.Linear(4, 3), nn.Linear(2, 2)
    trunk = nn.ModuleList([used, unused, noted])
    noted.weight.grad = torch.full_like(noted.weight, 0.25)
    buf = TaskGradBuffer(trunk.parameters(), modules=trunk, batch_dim=0,
                         update_every=update_every)
    for _ in range(2):
        losses = used(torch.randn(5, 4)).pow(2).sum(1)
        buf.backward(losses)
        buf.apply_(UPGrad())
        assert used.weight.grad is not None and used.bias.grad is not None
        assert unused.weight.grad is None and unused.bias.grad is None and noted.bias.grad is None
        assert bool((noted.weight.grad == 0.25).all())
