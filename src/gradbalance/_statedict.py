"""Checks on a ``state_dict`` handed to ``load_state_dict``: a state names the class that saved
it (:data:`TYPE_KEY`), so states whose keys coincide cannot cross."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

#: The key under which a state names the class that saved it.
TYPE_KEY = "_type"


def tag_state(owner: object, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` with :data:`TYPE_KEY` set to ``owner``'s class name."""
    return {TYPE_KEY: type(owner).__name__, **state}


def untag_state(owner: object, state: Any, kind: str) -> dict[str, Any]:
    """``state`` without :data:`TYPE_KEY`, once checked to be a dict saved by ``owner``'s class
    (``kind``: what ``owner`` is, in the messages)."""
    name = type(owner).__name__
    check_dict(name, state)
    check_saved_type(state.get(TYPE_KEY), name, kind)
    return {key: value for key, value in state.items() if key != TYPE_KEY}


def check_dict(owner: str, state: object) -> None:
    """``ValueError`` unless ``state`` is a mapping (what ``owner.state_dict()`` returns)."""
    if not isinstance(state, Mapping):
        raise ValueError(f"{owner}.load_state_dict expects the dict returned by state_dict(), "
                         f"got a {type(state).__name__}")


def check_saved_type(saved: Any, name: str, kind: str) -> None:
    """Raise ``ValueError`` unless the class ``saved`` recorded in a state is ``name``."""
    if saved is None:
        raise ValueError(
            f"state_dict does not name the class that saved it (no {TYPE_KEY!r}): a {kind}'s "
            f"state loads only into the class that saved it; pass the dict returned by "
            f"{name}.state_dict()"
        )
    if saved != name:
        raise ValueError(
            f"state_dict was saved by a {saved}, not a {name}: a {kind}'s state loads only "
            f"into the class that saved it; build a {saved} to resume it"
        )


def reject_state(owner: str, state: dict[str, Any], kind: str) -> None:
    """A stateless ``owner`` (a balancer, weighting or clipper: ``kind``) takes only ``{}``."""
    if state:
        raise ValueError(
            f"{owner} is stateless but state_dict has keys {sorted(state, key=str)}; was it saved "
            f"from another {kind}?"
        )


def check_keys(owner: str, state: dict[str, Any], allowed: Iterable[str],
               kind: str = "balancer") -> None:
    """Reject keys outside ``allowed`` (a state saved from another ``kind``)."""
    extra = sorted(set(state) - set(allowed), key=str)
    if extra:
        raise ValueError(
            f"state_dict has unexpected keys {extra} for {owner} (expected a subset of "
            f"{sorted(allowed)}); was it saved from another {kind}?"
        )


def as_lists(value: Any) -> Any:
    """Nested tuples and lists as lists (what every serialiser keeps)."""
    return [as_lists(v) for v in value] if isinstance(value, (list, tuple)) else value


def as_tuples(value: Any) -> Any:
    """Nested lists and tuples back as tuples (:func:`as_lists` undone)."""
    return tuple(as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
