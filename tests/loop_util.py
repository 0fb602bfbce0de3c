"""Helpers of the loop tests: build any registered balancer with default settings."""

from __future__ import annotations

import inspect

import pytest
import torch

from gradbalance import BALANCERS, Balancer

#: Constructor arguments for balancers that have required settings.
REQUIRED_ARGS = {"constant": lambda k: {"weights": [1.0, 0.5, 2.0, 1.5][:k]}}


def make_balancer(name: str, num_tasks: int, seed: int = 0) -> Balancer:
    """``BALANCERS[name]`` with defaults, ``num_tasks`` and a seeded generator if it takes one."""
    cls = BALANCERS[name]
    if name in REQUIRED_ARGS:
        return cls(**REQUIRED_ARGS[name](num_tasks))
    params = inspect.signature(cls).parameters
    kwargs: dict[str, object] = {}
    if "num_tasks" in params:
        kwargs["num_tasks"] = num_tasks
    if "generator" in params:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty
               and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in kwargs]
    if missing:
        pytest.fail(f"{name} needs {missing}: add it to loop_util.REQUIRED_ARGS")
    return cls(**kwargs)
