"""``batch_dim=0``: the step writes ``.grad`` itself, so it runs the parameters'
post-accumulate-grad hooks after writing, as plain ``backward`` and the task route do
(docs/loop.md, "When a step fails"); they never ran there. A hook that raises drops the step:
every ``.grad``, the balancer and ``update_every``'s counter as before, and the retried step
equals that of a run that never failed."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import UPGrad


def _model() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return nn.Linear(3, 4).double(), nn.Linear(4, 1).double()


def _data(step: int) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(5, 3, generator=gen, dtype=torch.float64),
            torch.randn(5, generator=gen, dtype=torch.float64))


def test_the_hooks_run_once_after_the_step_wrote() -> None:
    trunk, head = _model()
    seen: dict[str, Tensor] = {}
    for name, p in [*trunk.named_parameters(prefix="trunk"), *head.named_parameters(
            prefix="head")]:
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.__setitem__(name, p.grad.clone()))
    buf = TaskGradBuffer(trunk.parameters(), head.parameters(), modules=trunk, batch_dim=0)
    x, y = _data(0)
    buf.backward((head(trunk(x))[:, 0] - y) ** 2)
    buf.apply_(UPGrad())
    params = dict([*trunk.named_parameters(prefix="trunk"), *head.named_parameters(prefix="head")])
    assert seen.keys() == params.keys()
    assert all(torch.equal(seen[n], p.grad) for n, p in params.items())


@pytest.mark.parametrize("update_every", [1, 2])
def test_a_hook_that_raises_drops_the_step(update_every: int) -> None:
    def run(fail: bool) -> list[Tensor]:
        trunk, head = _model()
        armed = [fail]

        def hook(p: Tensor) -> None:
            if armed[0]:
                armed[0] = False
                raise RuntimeError("injected")

        trunk.weight.register_post_accumulate_grad_hook(hook)
        buf = TaskGradBuffer(trunk.parameters(), head.parameters(), modules=trunk,
                             batch_dim=0, update_every=update_every)
        bal = UPGrad()
        opt = torch.optim.SGD([*trunk.parameters(), *head.parameters()], lr=0.1)
        for step in range(4):
            x, y = _data(step)
            for _ in range(2):
                before = [None if p.grad is None else p.grad.clone()
                          for p in [*trunk.parameters(), *head.parameters()]]
                state = {k: v for k, v in buf.state_dict().items() if k != "steps_begun"}
                buf.backward((head(trunk(x))[:, 0] - y) ** 2)
                try:
                    buf.apply_(bal)
                    break
                except RuntimeError:
                    after = [p.grad for p in [*trunk.parameters(), *head.parameters()]]
                    assert all((a is None and b is None) or torch.equal(a, b)
                               for a, b in zip(after, before, strict=True))
                    kept = {k: v for k, v in buf.state_dict().items() if k != "steps_begun"}
                    assert str(kept) == str(state)  # steps_begun counts the dropped step
            opt.step()
            opt.zero_grad(set_to_none=True)
        return [p.detach().clone() for p in [*trunk.parameters(), *head.parameters()]]

    assert all(torch.equal(a, b) for a, b in zip(run(True), run(False), strict=True))
