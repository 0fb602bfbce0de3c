"""Helpers of the loop tests: build any registered balancer with default settings."""

from __future__ import annotations

from gradbalance import Balancer
from support.balancers import build_balancer


def make_balancer(name: str, num_tasks: int, seed: int = 0) -> Balancer:
    """``BALANCERS[name]`` with defaults, ``num_tasks`` and a seeded generator if it takes one."""
    return build_balancer(name, num_tasks, seed)
