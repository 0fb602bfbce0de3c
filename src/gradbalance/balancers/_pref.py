"""The shell of UPGrad, DualProj and ConFIG: a weight rule set by one preference ``pref``."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .._checks import as_pref
from ._base import Balancer


class PreferenceBalancer(Balancer):
    """``g = wᵀ G`` with ``w = rule(G Gᵀ, pref)``; ``pref`` ``[K]`` non-negative or None.

    A subclass sets ``name`` and ``rule`` (float64 weights on the CPU); ``pref=None`` is the
    rule's own default.
    """

    from_gramian = True
    _repr_args = ("num_tasks", "pref")
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
