"""The heads' ``.grad`` between the calls of a step: changed outside the buffer, or not.

A step spans several calls (``backward`` per micro-batch, then ``apply_``): each ``backward``
adds into the heads' ``.grad`` and into the trunk's task gradients, which the buffer holds
until ``apply_``. A ``zero_grad()`` between two calls (say after a forward that ran out of
memory) clears the heads' part of the step but not the trunk's, so the step would mix
micro-batches. :class:`GradWatch` notes, after each call, the identity and the version
counter (``Tensor._version``, bumped by every in-place write) of each watched ``.grad`` (the
heads'; the trunk's part of the step is in the buffer, not in its ``.grad``); the next call
compares them, O(number of parameters) attribute reads, no gradient value read, and
refuses the call before anything moves (docs/loop.md, "When a step fails").
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = ["GradWatch"]


def _how(before: Tensor | None, now: Tensor | None) -> str:
    if now is None:
        return "set to None"
    if before is None or now is not before:
        return "replaced by another tensor"
    return "written in place (e.g. zeroed)"


class GradWatch:
    """The ``.grad`` of some parameters as the buffer's last call of a step left them.

    ``params`` come with the names errors give them (``head_params[0]``, a module path).
    """

    def __init__(self) -> None:
        self._seen: list[tuple[str, Tensor, Tensor | None, int]] = []

    def record(self, params: Sequence[tuple[str, Tensor]]) -> None:
        """Note each ``.grad`` now (after a call of the step)."""
        self._seen = [(name, p, g, -1 if g is None else g._version)
                      for name, p in params for g in (p.grad,)]

    def clear(self) -> None:
        """The step is over: nothing to compare against."""
        self._seen = []

    def check(self, call: str, count: int) -> None:
        """Raise ``RuntimeError`` if a watched ``.grad`` changed since :meth:`record`."""
        for name, p, before, version in self._seen:
            now = p.grad
            if now is before and (now is None or now._version == version):
                continue
            raise RuntimeError(
                f"{call}(): the .grad of {name} (shape {tuple(p.shape)}) was "
                f"{_how(before, now)} outside the buffer since the last backward() of this "
                f"step, e.g. by optimizer.zero_grad() after a failed forward; the buffer still "
                f"holds the trunk's task gradients of {count} micro-batch(es) that the heads "
                f"no longer have. Call buf.reset() (it drops the step and puts the heads' .grad "
                f"back as before its first backward(); reset(keep_weights=True) keeps "
                f"update_every's weights), then run the step's forwards again "
                f"(docs/loop.md, 'When a step fails')"
            )
