"""The heads' ``.grad`` between the calls of a step: its identity and version counter after
each call, so that a ``zero_grad()`` in between is refused (docs/loop.md, "When a step fails").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

__all__ = ["GradWatch"]


def _how(before: Tensor | None, now: Tensor | None) -> str:
    if now is None:
        return "set to None"
    if before is None or now is not before:
        return "replaced by another tensor"
    return "written in place (e.g. zeroed)"


class GradWatch:
    """The ``.grad`` of some parameters as the buffer's last call of a step left them."""

    def __init__(self) -> None:
        self._seen: list[tuple[Tensor, Tensor | None, int]] = []  # (param, .grad, version)

    def record(self, params: Sequence[Tensor]) -> None:
        """Note each ``.grad`` now (after a call of the step)."""
        self._seen = [(p, p.grad, -1 if p.grad is None else p.grad._version) for p in params]

    def clear(self) -> None:
        """The step is over: nothing to compare against."""
        self._seen = []

    def check(self, call: str, count: int, name_of: Callable[[Tensor], str]) -> None:
        """Raise ``RuntimeError`` if a watched ``.grad`` changed since :meth:`record`;
        ``name_of`` names a parameter in the message."""
        for p, before, version in self._seen:
            now = p.grad
            if now is before and (now is None or now._version == version):
                continue
            raise RuntimeError(
                f"{call}(): the .grad of {name_of(p)} (shape {tuple(p.shape)}) was "
                f"{_how(before, now)} outside the buffer since the last backward() of this "
                f"step, e.g. by optimizer.zero_grad() after a failed forward; the buffer still "
                f"holds the trunk's task gradients of {count} micro-batch(es) that the heads "
                f"no longer have. Call buf.reset() (it drops the step and puts the heads' .grad "
                f"back as before its first backward(); reset(keep_weights=True) keeps "
                f"update_every's weights), then run the step's forwards again "
                f"(docs/loop.md, 'When a step fails')"
            )
