"""Partial labels with per-task state or settings (docs/loop.md, "Partial labels").

A masked step of a balancer with per-task state equals the same balancer built for the K'
active tasks, loaded with its state sliced by hand (``state_dict`` entries indexed here, not
by the code under test), on the active rows; the step's new state lands in the active tasks'
entries and the inactive ones stay bit-identical. A failing step moves nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from gradbalance import NonFiniteGradientError, TaskGradBuffer
from gradbalance.balancers import BALANCERS, Balancer, Constant, NashMTL, SolverError
from gradbalance.modes._masked import check_maskable, mask_balancer
from support.balancers import build_balancer

#: The per-task entries of each balancer's ``state_dict``: "row" (dim 0 per task) or "pair"
#: (``[K, K]``: both dims); every other entry is not per task and is kept whole.
PER_TASK = {
    "crmogm": {"_lambda": "row"},
    "dbmtl": {"_ema": "row"},
    "excessmtl": {"_root_sq_sum": "row", "_weights": "row", "_baseline": "row",
                  "_warmup_sum": "row"},
    "gradvac": {"targets": "pair"},
    "moco": {"_y": "row", "_lambda": "row"},
    "modo": {"_lambda": "row"},
    "nashmtl": {"alpha": "row"},
    "pcd": {"_ema": "row"},
    "sdmgrad": {"_w": "row"},
}
K, P = 5, 9
MASKS = [[True, True, False, True, False], [False, True, True, True, True],
         [True, False, False, False, True]]


def _take(value: Tensor, kind: str, idx: Tensor) -> Tensor:
    return value[idx][:, idx] if kind == "pair" else value[idx]


def _sliced_state(balancer: Balancer, name: str, idx: Tensor) -> dict[str, object]:
    kinds = PER_TASK[name]
    return {key: _take(v, kinds[key], idx) if key in kinds else copy.deepcopy(v)
            for key, v in balancer.state_dict().items()}


def _inputs(seed: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(K, P, generator=gen, dtype=torch.float64),
            torch.rand(K, generator=gen, dtype=torch.float64) + 0.5)


def _warmed(name: str) -> Balancer:
    balancer = build_balancer(name, K)
    for seed in (10, 11):  # two unmasked steps: every per-task state set and moved
        balancer(*_inputs(seed))
    return balancer


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name", sorted(PER_TASK))
def test_masked_step_equals_the_balancer_built_for_the_active_tasks(name, mask):
    active = torch.tensor(mask)
    idx = active.nonzero().reshape(-1)
    balancer = _warmed(name)
    reference = build_balancer(name, len(idx))
    reference.load_state_dict(_sliced_state(balancer, name, idx))
    before = copy.deepcopy(balancer.state_dict())
    matrix, losses = _inputs(12)

    out = mask_balancer(balancer, idx, K).combine(matrix, losses)
    expected = reference.combine(matrix[idx], losses[idx])

    torch.testing.assert_close(out.vector, expected.vector, rtol=1e-12, atol=1e-12)
    if expected.weights is not None:
        assert out.weights is not None
        torch.testing.assert_close(out.weights[idx], expected.weights, rtol=1e-12, atol=1e-12)
        assert bool((out.weights[~active] == 0).all())
    after, ref_after = balancer.state_dict(), reference.state_dict()
    kinds = PER_TASK[name]
    for key, value in after.items():
        if key in kinds:  # active entries: the reference's; inactive ones: untouched
            torch.testing.assert_close(_take(value, kinds[key], idx), ref_after[key],
                                       rtol=0, atol=0)
            _assert_inactive_unchanged(before[key], value, kinds[key], active)
        elif isinstance(value, Tensor):  # step counters move as on any step
            assert torch.equal(value, ref_after[key])
    assert balancer.num_tasks == K


def _assert_inactive_unchanged(old: Tensor, new: Tensor, kind: str, active: Tensor) -> None:
    assert new.shape == old.shape
    if kind == "row":
        assert torch.equal(new[~active], old[~active])
    else:  # every entry of a pair with an inactive task
        pairs = ~(active[:, None] & active[None, :])
        assert torch.equal(new[pairs], old[pairs])


@pytest.mark.parametrize("name", sorted(PER_TASK))
def test_masked_steps_leave_the_state_an_unmasked_step_can_use(name):
    """Masked steps with different masks, then an unmasked one: the state keeps K entries
    and the unmasked step equals a copy loaded with that state."""
    balancer = _warmed(name)
    for seed, mask in enumerate(MASKS):
        idx = torch.tensor(mask).nonzero().reshape(-1)
        mask_balancer(balancer, idx, K).combine(*_inputs(20 + seed))
    twin = build_balancer(name, K)
    twin.load_state_dict(copy.deepcopy(balancer.state_dict()))
    matrix, losses = _inputs(30)
    torch.testing.assert_close(balancer(matrix, losses), twin(matrix, losses), rtol=0, atol=0)


@pytest.mark.parametrize("mask", MASKS)
def test_constant_takes_the_active_weights(mask):
    active = torch.tensor(mask)
    idx = active.nonzero().reshape(-1)
    weights = [1.0, -2.0, 0.5, 3.0, 0.25]
    matrix, _ = _inputs(3)
    balancer = Constant(weights)
    out = mask_balancer(balancer, idx, K).combine(matrix)
    hand = sum(weights[i] * matrix[i] for i in idx.tolist())  # Σ over active tasks
    torch.testing.assert_close(out.vector, hand, rtol=1e-12, atol=1e-12)
    assert out.weights is not None
    assert out.weights.tolist() == [w if a else 0.0 for w, a in zip(weights, mask)]
    assert repr(balancer) == f"Constant(weights={weights})" and balancer.num_tasks == K


@pytest.mark.parametrize("name", sorted(PER_TASK))
def test_a_failing_masked_step_moves_nothing(name):
    """A non-finite active row raises inside the step: state, K and settings as before."""
    balancer = _warmed(name)
    before = copy.deepcopy(balancer.state_dict())
    matrix, losses = _inputs(4)
    matrix[3, 2] = float("nan")
    idx = torch.tensor([0, 3, 4])
    with pytest.raises(NonFiniteGradientError):
        mask_balancer(balancer, idx, K).combine(matrix, losses)
    _assert_same_state(before, balancer.state_dict())
    assert balancer.num_tasks == K


def test_a_solver_failure_under_a_mask_moves_nothing_and_the_step_can_rerun():
    """Nash-MTL raises on two exactly opposite active rows (no bargaining point): the
    balancer and ``.grad`` are as before, and an unmasked step still runs."""
    balancer = _warmed("nashmtl")
    balancer.no_solution = "raise"
    before = copy.deepcopy(balancer.state_dict())
    matrix, _ = _inputs(5)
    matrix[2] = -matrix[0]
    with pytest.raises(SolverError):
        mask_balancer(balancer, torch.tensor([0, 2]), K).combine(matrix)
    _assert_same_state(before, balancer.state_dict())
    assert balancer.num_tasks == K


def _assert_same_state(before: object, after: object) -> None:
    """Equal entry by entry, tensors bit for bit (generator states in the extra state too)."""
    if isinstance(before, dict):
        assert isinstance(after, dict) and before.keys() == after.keys()
        for key, value in before.items():
            _assert_same_state(value, after[key])
    elif isinstance(before, Tensor):
        assert isinstance(after, Tensor) and torch.equal(before, after)
    else:
        assert before == after


def test_nashmtl_through_apply_equals_the_active_tasks_balancer():
    """The issue's case end to end: ``apply_(NashMTL, active=)`` on a net's gradients."""
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    heads = nn.ModuleList(nn.Linear(3, 1) for _ in range(3)).double()
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(3, 8, 1, dtype=torch.float64)
    active = torch.tensor([True, False, True])
    balancer = NashMTL()
    balancer(torch.randn(3, 7, dtype=torch.float64))  # its first step, every task active
    reference = NashMTL()
    reference.load_state_dict({"alpha": balancer.alpha[[0, 2]].clone(),  # type: ignore[index]
                               "step": balancer.step.clone(),
                               "_extra_state": balancer.state_dict()["_extra_state"]})

    h = trunk(x)
    losses = torch.stack([((head(h) - y[i]) ** 2).mean() * active[i].double()
                          for i, head in enumerate(heads)])
    rows = [torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        losses[i], list(trunk.parameters()), retain_graph=True)]) for i in (0, 2)]
    expected = reference(torch.stack(rows))
    alpha_1 = balancer.alpha[1].clone()  # type: ignore[index]

    buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()))
    buf.backward(losses)
    buf.apply_(balancer, active=active)
    got = torch.cat([p.grad.reshape(-1) for p in trunk.parameters()])  # type: ignore[union-attr]
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    assert balancer.alpha is not None and reference.alpha is not None
    # the two routes' Gramians round alike on some BLAS builds only: equal to rounding
    torch.testing.assert_close(balancer.alpha[[0, 2]], reference.alpha, rtol=1e-9, atol=0.0)
    assert torch.equal(balancer.alpha[1], alpha_1) and int(balancer.step) == 2


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("name", sorted(PER_TASK))
def test_a_masked_first_step_is_the_active_tasks_first_step(name, mask):
    """Fresh (no per-task state yet), a masked step equals a fresh balancer built for the K'
    active tasks on their rows; the per-task state it would set stays unset, so the first
    step with every task active then equals a fresh balancer's first step, counters aside."""
    active = torch.tensor(mask)
    idx = active.nonzero().reshape(-1)
    balancer = build_balancer(name, K)
    unset = {key for key, (_, value) in balancer.task_state().items() if value is None}
    matrix, losses = _inputs(12)

    out = mask_balancer(balancer, idx, K).combine(matrix, losses)
    expected = build_balancer(name, len(idx)).combine(matrix[idx], losses[idx])

    torch.testing.assert_close(out.vector, expected.vector, rtol=1e-12, atol=1e-12)
    if expected.weights is not None:
        assert out.weights is not None
        torch.testing.assert_close(out.weights[idx], expected.weights, rtol=1e-12, atol=1e-12)
        assert bool((out.weights[~active] == 0).all())
    state = balancer.task_state()
    assert all(state[key][1] is None for key in unset)
    assert balancer.num_tasks == K
    if unset != set(state):  # GradVac built with K starts from zero targets: they moved
        return
    full, full_losses = _inputs(13)
    first = build_balancer(name, K)
    for key, value in balancer.state_dict().items():  # counters and generators as moved
        if key not in PER_TASK[name] and isinstance(value, Tensor):
            first.load_state_dict({**first.state_dict(), key: value.clone()})
    torch.testing.assert_close(balancer(full, full_losses), first(full, full_losses),
                               rtol=1e-12, atol=1e-12)


def test_a_masked_first_step_through_apply_moves_only_the_step():
    """Through the buffer: Nash-MTL's first step with task 1 unlabelled writes the trunk's
    gradient of Nash-MTL on tasks 0 and 2 (a balancer built for 2 tasks, computed here
    from rows taken by hand) and leaves ``alpha`` unset."""
    torch.manual_seed(1)
    trunk, head = nn.Linear(4, 3).double(), nn.Linear(3, 3).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    losses = (head(trunk(x)) ** 2).mean(0)
    rows = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        losses[k], list(trunk.parameters()), retain_graph=True)]) for k in (0, 2)])
    expected = NashMTL(2)(rows)
    buf = TaskGradBuffer(list(trunk.parameters()), list(head.parameters()))
    buf.backward(losses)
    balancer = NashMTL()
    buf.apply_(balancer, active=torch.tensor([True, False, True]))
    got = torch.cat([p.grad.reshape(-1) for p in trunk.parameters()])  # type: ignore[union-attr]
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)
    assert balancer.alpha is None and int(balancer.step) == 1


def test_no_fresh_balancer_refuses_a_mask():
    for name in BALANCERS:
        balancer = build_balancer(name, 3)
        check_maskable(balancer)
        balancer(*[t[:3] for t in _inputs(1)])
        check_maskable(balancer)


def test_state_trained_in_place_is_refused():
    class Trained(Balancer):
        from_gramian = True

        def __init__(self) -> None:
            super().__init__()
            self.register_state("scale", nn.Parameter(torch.ones(3, dtype=torch.float64)),
                                per_task=True)

        def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
            return self.scale.detach()

    with pytest.raises(ValueError, match=r"Trained trains its per-task state 'scale' in place"):
        mask_balancer(Trained(), torch.tensor([0, 2]), 3)


def test_tracked_tasks_are_checked_against_the_mask():
    balancer = _warmed("nashmtl")  # tracks K = 5
    with pytest.raises(ValueError, match="got 3 tasks but NashMTL tracks weights for 5"):
        mask_balancer(balancer, torch.tensor([0, 2]), 3)
