"""A step that fails in user code past the checks is dropped whole (docs/loop.md, "When a step
fails"): a trunk parameter's post-accumulate-grad hook raising after ``apply_`` wrote puts
back every ``.grad``, the balancer's state and ``update_every``'s counter; a tensor hook that
draws from torch's generator and then raises in ``backward`` leaves the generator as it was.
After either, the next step equals that of a run that never failed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import GradVac

K = 3


def _model() -> tuple[nn.Module, nn.ModuleList]:
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 5), nn.Tanh()).double()
    heads = nn.ModuleList(nn.Linear(5, 1) for _ in range(K)).double()
    return trunk, heads


def _losses(trunk: nn.Module, heads: nn.ModuleList, x: Tensor, y: Tensor) -> Tensor:
    f = trunk(x)
    return torch.stack([((h(f)[:, 0] - y[:, k]) ** 2).mean() for k, h in enumerate(heads)])


def _grads(params: list[Tensor]) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in params]


def _same(a: list[Tensor | None], b: list[Tensor | None]) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None
                                             and torch.equal(x, y)) for x, y in zip(a, b))


def _equal_state(a: object, b: object) -> bool:
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal_state(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.mark.parametrize("mode", ["matrix", "gramian"])
@pytest.mark.parametrize("update_every", [1, 2])
@pytest.mark.parametrize("start", ["none", "filled"])
def test_a_post_accumulate_hook_raising_drops_the_step(mode: str, update_every: int,
                                                       start: str) -> None:
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 4, generator=gen, dtype=torch.float64),
             torch.randn(6, K, generator=gen, dtype=torch.float64)) for _ in range(3)]
    runs = []
    for failing in (True, False):
        trunk, heads = _model()
        params = [*trunk.parameters(), *heads.parameters()]
        balancer = GradVac(num_tasks=K)
        buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()), mode=mode,
                             update_every=update_every,
                             **({"modules": trunk} if mode == "gramian" else {}))
        fail = [False]

        def hook(p: Tensor, fail: list[bool] = fail) -> None:
            if fail[0]:
                raise RuntimeError("hook failed")

        trunk[0].bias.register_post_accumulate_grad_hook(hook)
        seen = []
        for i, (x, y) in enumerate(data):
            for p in params:
                p.grad = None if start == "none" else torch.full_like(p, 0.25)
            if failing and i == 1:  # the failed attempt, then the same step again
                fail[0] = True
                before, state = _grads(params), copy.deepcopy(balancer.state_dict())
                counter = buf.state_dict()
                buf.backward(_losses(trunk, heads, x, y))
                with pytest.raises(RuntimeError, match="hook failed"):
                    buf.apply_(balancer)
                assert _same(_grads(params), before)
                assert _equal_state(balancer.state_dict(), state)
                assert buf.state_dict()["step"] == counter["step"]
                fail[0] = False
            buf.backward(_losses(trunk, heads, x, y))
            buf.apply_(balancer)
            seen.append(_grads(params))
        runs.append(seen)
    for failed, plain in zip(*runs):
        assert _same(failed, plain)


@pytest.mark.parametrize("mode", ["matrix", "gramian", "features"])
def test_a_hook_drawing_then_raising_in_backward_leaves_the_generator(mode: str) -> None:
    trunk, heads = _model()
    buf = TaskGradBuffer(list(trunk.parameters()), list(heads.parameters()), mode=mode,
                         **({"modules": trunk} if mode == "gramian" else {}))
    x = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randn(6, K, dtype=torch.float64)
    f = trunk(x)
    calls = [0]

    def noisy(grad: Tensor) -> Tensor:  # gradient noise, failing on the second task's pass
        calls[0] += 1
        noise = torch.randn_like(grad)
        if calls[0] == 2:
            raise RuntimeError("hook failed")
        return grad + 0.0 * noise

    f.register_hook(noisy)
    losses = torch.stack([((h(f)[:, 0] - y[:, k]) ** 2).mean() for k, h in enumerate(heads)])
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="hook failed"):
        buf.backward(losses, features=f if mode == "features" else None)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in [*trunk.parameters(), *heads.parameters()])
