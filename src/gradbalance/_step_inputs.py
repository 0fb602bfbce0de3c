"""Parameters a balanced step refuses at construction: complex ones, since the balancers work on
real Gramians (docs/loop.md, "Inputs plain PyTorch takes")."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = ["refuse_complex"]


def refuse_complex(name: str, params: Sequence[Tensor], names: dict[int, str]) -> None:
    """Raise ``ValueError`` naming the first complex parameter of ``params``."""
    for i, p in enumerate(params):
        if p.is_complex():
            module = names.get(id(p))
            where = f"{name}[{i}]" if module is None else f"{name}[{i}] ('{module}')"
            raise ValueError(
                f"{where} (shape {tuple(p.shape)}) is complex ({p.dtype}); balanced steps "
                f"take real parameters only: store it as a real parameter, e.g. "
                f"nn.Parameter(torch.view_as_real(z)) of shape (..., 2), and make it complex "
                f"inside the forward with torch.view_as_complex(w)"
            )
