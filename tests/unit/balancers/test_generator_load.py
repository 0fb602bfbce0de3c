"""A generator state torch would refuse is refused at load, before the balancer moves."""

from __future__ import annotations

import pytest
import torch

from gradbalance.balancers import GradDrop, GradVac, PCGrad, Random


def _builders() -> list[tuple[str, object]]:
    return [
        ("pcgrad", lambda: PCGrad()),
        ("gradvac", lambda: GradVac()),
        ("graddrop", lambda: GradDrop(generator=torch.Generator().manual_seed(3))),
        ("random", lambda: Random(generator=torch.Generator().manual_seed(3))),
    ]


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for key, value in a.items():
        other = b[key]
        if isinstance(value, dict):
            if not (isinstance(other, dict) and _same(value, other)):
                return False
        elif isinstance(value, torch.Tensor):
            if not (isinstance(other, torch.Tensor) and torch.equal(value, other)):
                return False
        elif value != other:
            return False
    return True


@pytest.mark.parametrize("name,build", _builders(), ids=[n for n, _ in _builders()])
@pytest.mark.parametrize("bad", [torch.zeros(7, dtype=torch.uint8),
                                 torch.full((5056,), 255, dtype=torch.uint8)[:100]],
                         ids=["short", "truncated"])
@pytest.mark.parametrize("seed", [0, 1])
def test_bad_generator_state_raises_and_changes_nothing(name, build, bad, seed) -> None:
    torch.manual_seed(seed)
    balancer = build()
    grads = torch.randn(3, 6, dtype=torch.float64)
    balancer(grads)  # some state to keep (GradVac's targets, the generators' positions)
    before = balancer.state_dict()
    state = balancer.state_dict()
    state["_extra_state"] = dict(state["_extra_state"], generator=bad)
    with pytest.raises(ValueError, match="generator"):
        balancer.load_state_dict(state)
    assert _same(balancer.state_dict(), before)
    # The generator did not move: the next update equals a twin's loaded from `before`.
    twin = build()
    twin.load_state_dict(before)
    torch.testing.assert_close(balancer(grads), twin(grads), rtol=0, atol=0)
