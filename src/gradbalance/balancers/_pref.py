"""The shell of a stateless weighted balancer set by one preference vector ``pref``.

Not a balancer module (no ``__all__``). UPGrad, DualProj and ConFIG differ only in their weight
rule ``rule(gramian, pref) -> [K]``; this class holds ``pref`` and calls the rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .._checks import as_pref
from ._base import Balancer


class PreferenceBalancer(Balancer):
    """``g = wᵀ G`` with ``w = rule(G Gᵀ, pref)``; ``pref`` ``[K]`` non-negative or None.

    A subclass sets ``name`` and ``rule`` (a function of the Gramian and ``pref`` returning
    float64 weights on the CPU). None means the rule's own default preference.
    """

    from_gramian = True
    homogeneous = True
    weight_degree = 0.0  # each rule's weights are scale-free

    @staticmethod
    def rule(gramian: Tensor, pref: Tensor | None) -> Tensor:
        """The weights ``[K]`` from the Gramian and ``pref``; each subclass sets its own."""
        raise NotImplementedError

    def __init__(
        self, num_tasks: int | None = None, *, pref: Sequence[float] | Tensor | None = None
    ) -> None:
        super().__init__(num_tasks)
        self.pref = as_pref("pref", pref)

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        return type(self).rule(gramian, self.pref).to(gramian.device)

    def __repr__(self) -> str:
        pref = None if self.pref is None else self.pref.tolist()
        return f"{type(self).__name__}(num_tasks={self.num_tasks}, pref={pref})"
