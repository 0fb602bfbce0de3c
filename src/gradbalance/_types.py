"""The error a non-finite gradient raises. Shapes throughout: ``K`` tasks, ``P`` shared values,
``G`` ``[K, P]``, its Gramian ``[K, K]`` (float64), the weights ``[K]``, the update ``[P]``."""

from __future__ import annotations

__all__ = ["NonFiniteGradientError"]


class NonFiniteGradientError(ValueError):
    """A task gradient (or Gramian) holds inf or NaN; no state was changed.

    Example:
        >>> import torch
        >>> from gradbalance import NonFiniteGradientError
        >>> from gradbalance.functional import clip_task_norms_
        >>> G = torch.tensor([[float("inf"), 0.0], [3.0, 4.0]])
        >>> try:
        ...     clip_task_norms_(G, max_norm=1.0, error_if_nonfinite=True)
        ... except NonFiniteGradientError:
        ...     print("skip this step; G unchanged:", G[1].tolist())
        skip this step; G unchanged: [3.0, 4.0]
    """
