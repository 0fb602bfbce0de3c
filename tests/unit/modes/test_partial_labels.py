"""Partial labels: ``apply_(balancer, active=mask)`` equals the balancer on the active rows.

The expected update is built independently: each active task's gradient by
``torch.autograd.grad``, stacked into the ``[K', P]`` matrix by hand and given to a fresh copy
of the balancer (docs/loop.md, "Partial labels").
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gradbalance import TaskGradBuffer, balanced_backward
from gradbalance.balancers import BALANCERS, IMTLG, MGDA, Balancer, NashMTL, PCGrad, UPGrad
from support.balancers import build_balancer

CLASSES = [MGDA, IMTLG, UPGrad, PCGrad]
MASKS = {2: [[True, False], [False, True]],
         3: [[True, False, True], [False, True, True], [False, False, True]],
         5: [[True, True, False, True, False], [False, True, True, True, True]]}
CASES = [(k, m) for k, masks in MASKS.items() for m in masks]


class Net(nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        self.heads = nn.ModuleList(nn.Linear(3, 1) for _ in range(k))


def _setup(k: int, seed: int) -> tuple[Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    net = Net(k).double()
    return net, torch.randn(7, 4, dtype=torch.float64), torch.randn(k, 7, 1, dtype=torch.float64)


def _losses(net: Net, x: torch.Tensor, y: torch.Tensor, active: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-task MSE; a task without labels has loss 0 (and a zero gradient)."""
    h = net.trunk(x)
    rows = [((head(h) - y[i]) ** 2).mean() * active[i].double()
            for i, head in enumerate(net.heads)]
    return torch.stack(rows), h


def _expected(net: Net, x: torch.Tensor, y: torch.Tensor, active: torch.Tensor,
              balancer: Balancer, on_features: bool
              ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The trunk's and heads' gradients: the balancer on the K' active rows, built by hand."""
    losses, h = _losses(net, x, y, active)
    trunk = list(net.trunk.parameters())
    wrt = [h] if on_features else trunk
    idx = [i for i in range(len(active)) if bool(active[i])]
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(losses[i], wrt,
                                                                   retain_graph=True)])
            for i in idx]
    reference = copy.deepcopy(balancer)
    reference.num_tasks = None  # a copy for the K' active tasks
    vector = reference(torch.stack(rows), losses.detach()[idx])
    if on_features:
        trunk_grads = list(torch.autograd.grad(h, trunk, vector.reshape(h.shape),
                                               retain_graph=True))
    else:
        sizes = [p.numel() for p in trunk]
        trunk_grads = [v.reshape(p.shape) for v, p in zip(vector.split(sizes), trunk)]
    heads = list(net.heads.parameters())
    head_grads = list(torch.autograd.grad(losses.sum(), heads))
    return trunk_grads, head_grads


def _run(net: Net, x: torch.Tensor, y: torch.Tensor, active: torch.Tensor, balancer: Balancer,
         mode: str):
    net.zero_grad(set_to_none=True)
    buf = TaskGradBuffer(list(net.trunk.parameters()), list(net.heads.parameters()), mode=mode,
                         modules=net.trunk if mode in ("gramian", "auto") else None)
    losses, h = _losses(net, x, y, active)
    buf.backward(losses, features=h if mode == "features" else None)
    return buf.apply_(balancer, active=active)


@pytest.mark.parametrize("mode", ["matrix", "gramian", "auto", "features"])
@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize(("k", "mask"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_the_balancer_on_the_active_rows(mode, cls, k, mask, seed):
    net, x, y = _setup(k, seed)
    active = torch.tensor(mask)
    balancer = cls()
    trunk, heads = _expected(net, x, y, active, balancer, mode == "features")
    stats = _run(net, x, y, active, balancer, mode)
    for p, g in zip(net.trunk.parameters(), trunk):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-9)
    for p, g in zip(net.heads.parameters(), heads):
        torch.testing.assert_close(p.grad, g, rtol=1e-9, atol=1e-12)
    assert stats.weights is not None
    assert bool((stats.weights[~active] == 0).all())


#: Per-task state or settings: test_partial_labels_state.py.
PER_TASK_STATE = ["constant", "crmogm", "dbmtl", "excessmtl", "gradvac", "moco", "modo",
                  "nashmtl", "pcd", "sdmgrad"]


@pytest.mark.parametrize("name", sorted(set(BALANCERS) - set(PER_TASK_STATE)))
def test_every_maskable_balancer_equals_itself_on_the_active_rows(name):
    k, active = 5, torch.tensor([True, True, False, True, True])
    net, x, y = _setup(k, 7)
    balancer = build_balancer(name, k)
    trunk, _ = _expected(net, x, y, active, balancer, False)
    stats = _run(net, x, y, active, balancer, "matrix")
    for p, g in zip(net.trunk.parameters(), trunk):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-9)
    if stats.weights is not None:
        assert float(stats.weights[2]) == 0.0


@pytest.mark.parametrize("cls", [MGDA, IMTLG, UPGrad, PCGrad])
def test_balanced_backward_and_num_tasks(cls):
    k, active = 3, torch.tensor([True, False, True])
    net, x, y = _setup(k, 3)
    balancer = cls(num_tasks=k)
    trunk, _ = _expected(net, x, y, active, cls(), False)
    losses, _ = _losses(net, x, y, active)
    balanced_backward(losses, balancer, shared_params=list(net.trunk.parameters()),
                      head_params=list(net.heads.parameters()), active=active)
    for p, g in zip(net.trunk.parameters(), trunk):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-9)
    assert balancer.num_tasks == k


def test_unlabelled_task_no_longer_zeroes_mgda():
    """Without a mask MGDA's min-norm point is the zero row; with it, the labelled tasks'."""
    k, active = 3, torch.tensor([True, True, False])
    net, x, y = _setup(k, 4)
    _run(net, x, y, active, MGDA(), "matrix")
    masked = [p.grad.clone() for p in net.trunk.parameters()]
    net.zero_grad(set_to_none=True)
    buf = TaskGradBuffer(list(net.trunk.parameters()), list(net.heads.parameters()))
    buf.backward(_losses(net, x, y, active)[0])
    buf.apply_(MGDA())
    assert all(float(p.grad.abs().max()) == 0.0 for p in net.trunk.parameters())
    assert any(float(g.abs().max()) > 0.0 for g in masked)


@pytest.mark.parametrize("mode", ["matrix", "gramian", "features"])
def test_all_true_mask_is_no_mask(mode):
    k = 3
    net, x, y = _setup(k, 5)
    active = torch.ones(k, dtype=torch.bool)
    _run(net, x, y, active, NashMTL(), mode)
    first = _grads(net)
    net.zero_grad(set_to_none=True)
    buf = TaskGradBuffer(list(net.trunk.parameters()), list(net.heads.parameters()), mode=mode,
                         modules=net.trunk if mode == "gramian" else None)
    losses, h = _losses(net, x, y, active)
    buf.backward(losses, features=h if mode == "features" else None)
    buf.apply_(NashMTL())
    for a, p in zip(first, net.parameters()):
        torch.testing.assert_close(p.grad, a)


def _prepared(k: int, mode: str = "matrix", update_every: int = 1):
    net, x, y = _setup(k, 6)
    for p in net.parameters():
        p.grad = torch.full_like(p, 0.25)
    buf = TaskGradBuffer(list(net.trunk.parameters()), list(net.heads.parameters()), mode=mode,
                         update_every=update_every)
    active = torch.tensor([True, False, True])
    buf.backward(_losses(net, x, y, active)[0])
    return net, buf, active


def _unmoved(net: Net, before: list[torch.Tensor]) -> bool:
    return all(torch.equal(p.grad, b) for p, b in zip(net.parameters(), before))


def _grads(net: Net) -> list[torch.Tensor]:
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize(("active", "error", "match"), [
    (torch.tensor([False, False, False]), ValueError, "all False"),
    (torch.tensor([True, False]), ValueError, r"shape \[K\] = \[3\]"),
    (torch.tensor([1, 0, 1]), TypeError, "bool tensor"),
    ([True, False, True], TypeError, "bool tensor"),
])
def test_bad_mask_is_refused_and_moves_nothing(active, error, match):
    net, buf, good = _prepared(3)
    balancer, before = UPGrad(), _grads(net)
    with pytest.raises(error, match=match):
        buf.apply_(balancer, active=active)
    assert _unmoved(net, before)
    buf.apply_(balancer, active=good)  # the step was left: it still runs
    assert not _unmoved(net, before)


def test_update_every_refuses_a_partial_mask():
    net, buf, active = _prepared(3, update_every=2)
    before = _grads(net)
    with pytest.raises(ValueError, match="update_every=2"):
        buf.apply_(UPGrad(), active=active)
    assert _unmoved(net, before)
    buf.apply_(UPGrad(), active=torch.ones(3, dtype=torch.bool))


def test_docs_example_runs():
    import contextlib
    import io
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "loop.md").read_text()
    section = page.split("## Partial labels")[1].split("\n## ")[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace: dict[str, object] = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(block, "loop.md", "exec"), namespace)
    weights = namespace["stats"].weights  # type: ignore[attr-defined]
    assert "0.0000" in printed.getvalue() and weights[1] == 0
    assert torch.isclose(weights[0] + weights[2], torch.tensor(1.0, dtype=weights.dtype))


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("runs", [((0, 5),), ((5, 3), (9, 3))])
def test_sharded_columns_equal_the_active_rows_columns(cls, runs):
    """Under a sharded trunk a rank's columns of the masked update are those of the balancer
    on the active rows (the full Gramian given, as the sharded mode passes it)."""
    from gradbalance.balancers import Shard
    from gradbalance.modes._masked import mask_balancer

    torch.manual_seed(8)
    matrix = torch.randn(4, 12, dtype=torch.float64)
    index = torch.tensor([0, 2, 3])
    expected = cls()(matrix[index])
    cols = torch.cat([torch.arange(s, s + n) for s, n in runs])
    masked = mask_balancer(cls(), index, 4)
    out = masked.combine(matrix[:, cols], gramian=matrix @ matrix.T,
                         shard=Shard(runs, 12, lambda t: t))
    torch.testing.assert_close(out.vector, expected[cols], rtol=1e-6, atol=1e-9)
    assert out.weights is not None and float(out.weights[1]) == 0.0


def test_per_sample_objectives_refuse_a_mask_and_move_nothing():
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    buf = TaskGradBuffer(model.parameters(), modules=model, batch_dim=0)
    buf.backward(model(torch.randn(4, 3))[:, 0] ** 2)
    before = [p.grad.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="batch_dim=0 every sample is an objective"):
        buf.apply_(UPGrad(), active=torch.ones(4, dtype=torch.bool))
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    buf.apply_(UPGrad())


def test_too_few_active_tasks_for_the_balancer_drops_the_step_atomically():
    """Krum needs 3 tasks: a mask leaving 2 raises, the balancer's num_tasks is back and every
    ``.grad`` is as before the step's backward (a failure past the checks drops the step)."""
    from gradbalance.balancers import Krum

    net, buf, active = _prepared(3)
    balancer = Krum(num_tasks=3)
    with pytest.raises(ValueError, match="Krum"):
        buf.apply_(balancer, active=active)
    assert balancer.num_tasks == 3
    assert all(bool((p.grad == 0.25).all()) for p in net.parameters())
