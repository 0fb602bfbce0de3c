"""Pieces every figure shares: claims, missing library parts, angles, plotting, the bowls.

The two-bowl example (`docs/figures.md`, §7.2): two tasks share two weights ``w``; task
``k``'s loss is ``Lₖ(w) = ½ (w − cₖ)ᵀ H (w − cₖ)`` with ``c₁ = (3, 0)``, ``c₂ = (0, 3)`` and
``H = diag(10, 1)`` (each bowl ten times steeper along the first weight). Both bowls share
``H``, so the Pareto set is the segment from ``c₁`` to ``c₂``: there, and only there, the two
gradients point exactly opposite. "Batch noise" is added as ``ξₖ·w`` to each loss, so task
``k``'s gradient is its exact gradient plus ``ξₖ`` (Gaussian, drawn from an explicit
generator). Every step runs through the library: :class:`~gradbalance.TaskGradBuffer`, a
registered balancer and a ``torch.optim`` optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from gradbalance._optional import pyplot as optional_pyplot
from gradbalance.balancers import BALANCERS, Balancer, get_balancer
from gradbalance.step import TaskGradBuffer

__all__ = [
    "BOWL_CENTERS",
    "BOWL_CURVATURE",
    "Claim",
    "Missing",
    "TwoBowls",
    "angle_deg",
    "pyplot",
    "require_attr",
    "require_balancer",
]


@dataclass
class Claim:
    """One claim of the text beside what was measured.

    ``met`` is True/False when the claim has a checkable number, None when it is shown only.
    """

    text: str
    measured: str
    met: bool | None = None


class Missing(RuntimeError):
    """A library piece the figure needs is not in this build (the figure reports it)."""


def require_balancer(name: str, **kwargs: Any) -> Balancer:
    """The registered balancer ``name``, or :class:`Missing` naming what is needed."""
    if name not in BALANCERS:
        raise Missing(f"needs the {name!r} balancer (gradbalance.balancers._{name})")
    return get_balancer(name, **kwargs)


def require_attr(module: str, attr: str) -> Any:
    """``gradbalance.<module>.<attr>``, or :class:`Missing` naming what is needed."""
    import importlib

    try:
        mod = importlib.import_module(f"gradbalance.{module}")
    except ModuleNotFoundError as error:
        if error.name and error.name.startswith("gradbalance"):
            raise Missing(f"needs gradbalance.{module}.{attr}") from error
        raise
    if not hasattr(mod, attr):
        raise Missing(f"needs gradbalance.{module}.{attr}")
    return getattr(mod, attr)


def angle_deg(a: Tensor, b: Tensor) -> float:
    """Angle between two vectors in degrees (0 when either is zero)."""
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    den = float(a.norm() * b.norm())
    if den == 0.0:
        return 0.0
    cos = max(-1.0, min(1.0, float(a @ b) / den))
    return math.degrees(math.acos(cos))


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a clear error naming the extra."""
    return optional_pyplot("gradbalance figures (its PNGs)", "run with --no-plot")


def save_figure(fig: Any, path: Any) -> None:
    """Lay out ``fig``, write it to ``path`` as a 100 dpi PNG and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


BOWL_CENTERS = ((3.0, 0.0), (0.0, 3.0))
BOWL_CURVATURE = (10.0, 1.0)


@dataclass
class TwoBowls:
    """The two-bowl example, trained through the library's step.

    Args:
        start: initial weights.
        noise: standard deviation of the per-coordinate Gaussian gradient noise (0: exact).
        seed: seed of the noise generator.
    """

    start: tuple[float, float] = (-1.0, 5.0)
    noise: float = 0.0
    seed: int = 0
    centers: Tensor = field(init=False)
    curvature: Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.centers = torch.tensor(BOWL_CENTERS, dtype=torch.float64)
        self.curvature = torch.tensor(BOWL_CURVATURE, dtype=torch.float64)
        self.weights = torch.nn.Parameter(torch.tensor(self.start, dtype=torch.float64))
        self.generator = torch.Generator().manual_seed(self.seed)

    def draw_noise(self, sigma: float) -> Tensor:
        """Gradient noise ``[2, 2]`` (one row per task) from the bowls' generator."""
        return torch.randn(2, 2, generator=self.generator, dtype=torch.float64) * sigma

    def losses(self, noise: float | None = None, xi: Tensor | None = None) -> Tensor:
        """The two task losses ``[2]`` at the current weights.

        Task ``k``'s gradient is exact plus ``xi[k]``; without ``xi``, fresh noise of standard
        deviation ``noise`` (default: the bowls' own) is drawn.
        """
        w = self.weights
        diff = w.unsqueeze(0) - self.centers
        exact = 0.5 * (diff.pow(2) * self.curvature).sum(dim=1)
        if xi is None:
            sigma = self.noise if noise is None else noise
            xi = self.draw_noise(sigma) if sigma > 0 else None
        if xi is not None:
            exact = exact + (xi * w.unsqueeze(0)).sum(dim=1)
        return exact

    def exact_gradients(self, w: Tensor | None = None) -> Tensor:
        """Exact task gradients ``[2, 2]`` at ``w`` (default: the current weights)."""
        w = self.weights.detach() if w is None else w
        return (w.unsqueeze(0) - self.centers) * self.curvature

    @staticmethod
    def pareto_distance(w: Tensor) -> float:
        """Euclidean distance from ``w`` to the Pareto set, the segment ``c₁c₂``."""
        c1 = torch.tensor(BOWL_CENTERS[0], dtype=torch.float64)
        c2 = torch.tensor(BOWL_CENTERS[1], dtype=torch.float64)
        d = c2 - c1
        t = float(((w.double() - c1) @ d) / (d @ d))
        t = min(1.0, max(0.0, t))
        return float((w.double() - (c1 + t * d)).norm())

    def train(
        self,
        balancer: Balancer,
        make_optimizer: Callable[[list[Tensor]], torch.optim.Optimizer],
        steps: int,
        record_every: int = 1,
    ) -> dict[str, list[float]]:
        """Run ``steps`` balanced steps; return the path and per-step diagnostics.

        Per step: ``step`` is ``‖w_{t+1} − w_t‖``; ``update`` the norm of the balanced gradient
        the library wrote into ``.grad``; ``tilt`` the angle (degrees) between the optimizer's
        step ``−Δw`` and that balanced gradient. Every ``record_every`` steps (and at the end):
        the weights ``x``, ``y`` and the distance ``pareto`` to the Pareto set.
        """
        opt = make_optimizer([self.weights])
        buf = TaskGradBuffer([self.weights], num_tasks=2)
        out: dict[str, list[float]] = {k: [] for k in ("x", "y", "pareto", "step", "update",
                                                         "tilt")}
        for t in range(steps):
            before = self.weights.detach().clone()
            buf.backward(self.losses())
            stats = buf.apply_(balancer)
            grad = self.weights.grad.detach().clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
            now = self.weights.detach()
            delta = before - now
            out["step"].append(float(delta.norm()))
            out["update"].append(float(stats.update_norm))
            out["tilt"].append(angle_deg(delta, grad))
            if t % record_every == 0 or t == steps - 1:
                out["x"].append(float(now[0]))
                out["y"].append(float(now[1]))
                out["pareto"].append(self.pareto_distance(now))
        return out
