"""Checks on a ``state_dict`` handed to ``load_state_dict`` (shared by every stateful object).

A state saved from another object should fail loudly, naming the keys found, not load half.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def reject_state(owner: str, state: dict[str, Any], kind: str) -> None:
    """A stateless ``owner`` (a balancer, weighting or clipper: ``kind``) takes only ``{}``."""
    if state:
        raise ValueError(
            f"{owner} is stateless but state_dict has keys {sorted(state)}; was it saved from "
            f"another {kind}?"
        )


def check_keys(owner: str, state: dict[str, Any], allowed: Iterable[str],
               kind: str = "balancer") -> None:
    """Reject keys outside ``allowed`` (a state saved from another ``kind``)."""
    extra = sorted(set(state) - set(allowed))
    if extra:
        raise ValueError(
            f"state_dict has unexpected keys {extra} for {owner} (expected a subset of "
            f"{sorted(allowed)}); was it saved from another {kind}?"
        )
