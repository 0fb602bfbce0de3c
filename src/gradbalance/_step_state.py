"""The heads' ``.grad`` between the calls of a step: its identity and version counter after
each call, so that a ``zero_grad()`` in between is refused (docs/loop.md, "When a step fails").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

__all__ = ["GradWatch", "StepCounter"]


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


class StepCounter:
    """The steps a buffer has begun, which ``apply_`` compares across the data-parallel ranks
    (docs/distributed.md): a step counts when its first ``backward`` begins, past the call's
    checks, whether it then finishes or is dropped, and a ``reset()`` with no step begun since
    the last finished one counts the batch it abandons (a forward that raised before any
    ``backward``). So ranks that drop the same batch, each wherever it failed, stay equal,
    and a rank that skipped a batch the others took is one ahead at their next ``apply_``.

    Example:
        >>> from gradbalance._step_state import StepCounter
        >>> steps = StepCounter()
        >>> steps.begin(); steps.finished()  # a step
        >>> steps.begin(); steps.reset()      # one dropped after its first backward
        >>> steps.reset()                     # one abandoned before any backward
        >>> steps.count
        3
    """

    def __init__(self) -> None:
        self.count = 0
        self._open = False  # a step began since the last finished one or reset

    def begin(self) -> None:
        """A step's first ``backward`` is past its checks."""
        self.count += 1
        self._open = True

    def finished(self) -> None:
        """``apply_`` wrote the step."""
        self._open = False

    def reset(self) -> None:
        """The buffer's ``reset()``: the batch is dropped; counted here if no step began."""
        if not self._open:
            self.count += 1
        self._open = False

    def load(self, count: int) -> None:
        """A loaded ``steps_begun``."""
        self.count, self._open = count, False
