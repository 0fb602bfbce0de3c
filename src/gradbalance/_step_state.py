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
        self._params: list[Tensor] = []
        self._grads: list[Tensor | None] = []
        self._versions: list[int] = []

    def record(self, params: Sequence[Tensor]) -> None:
        """Note each ``.grad`` now (after a call of the step)."""
        self._params = list(params)
        self._grads = grads = [p.grad for p in self._params]
        self._versions = [-1 if g is None else g._version for g in grads]

    def clear(self) -> None:
        """The step is over: nothing to compare against."""
        self._params, self._grads, self._versions = [], [], []

    def check(self, call: str, count: int, name_of: Callable[[Tensor], str]) -> None:
        """Raise ``RuntimeError`` if a watched ``.grad`` changed since :meth:`record`;
        ``name_of`` names a parameter in the message."""
        for p, before, version in zip(self._params, self._grads, self._versions):
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
