"""Helpers of the loop tests: build any registered balancer with default settings."""

from __future__ import annotations

from balancer_util import build_balancer
from gradbalance import Balancer


def make_balancer(name: str, num_tasks: int, seed: int = 0) -> Balancer:
    """``BALANCERS[name]`` with defaults, ``num_tasks`` and a seeded generator if it takes one."""
    return build_balancer(name, num_tasks, seed)
