"""Pieces every figure shares: claims, missing library parts, angles, plotting, the bowls.

The two-bowl example (`docs/figures.md`, §7.2): two tasks share two weights ``w``; task
``k``'s loss is ``Lₖ(w) = ½ (w − cₖ)ᵀ H (w − cₖ)`` with ``c₁ = (3, 0)``, ``c₂ = (0, 3)`` and
``H = diag(10, 1)`` (each bowl ten times steeper along the first weight). Both bowls share
``H``, so the Pareto set is the segment from ``c₁`` to ``c₂``: there, and only there, the two
gradients point exactly opposite. "Batch noise" is added as ``ξₖ·w`` to each loss, so task
``k``'s gradient is its exact gradient plus ``ξₖ`` (Gaussian, drawn from an explicit
generator). Every step of :class:`TwoBowls` runs through the library:
:class:`~gradbalance.TaskGradBuffer`, a registered balancer and a ``torch.optim`` optimizer;
:func:`train_bowls` runs many of them at once with the balancers' two-task closed forms, and
the figures that use it check it against :class:`TwoBowls` and the balancers.
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
    "KERNELS",
    "Claim",
    "Missing",
    "TwoBowls",
    "angle_deg",
    "angles_deg",
    "bowl_gradients",
    "bowl_noise",
    "grad_of",
    "kernel_gap",
    "mean_se",
    "mgda_two",
    "pareto_distances",
    "pcgrad_two",
    "pyplot",
    "require_attr",
    "require_balancer",
    "seed_range",
    "train_bowls",
]


@dataclass
class Claim:
    """One claim of the text beside what was measured.

    ``met`` is True/False when the claim has a checkable number, None when it is shown only;
    ``reason`` (with ``met`` None) says why the claim is not measurable, e.g. the text gives no
    number to compare with.
    """

    text: str
    measured: str
    met: bool | None = None
    reason: str = ""


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


def grad_of(param: Tensor) -> Tensor:
    """``param.grad`` (detached), which the step must have written."""
    if param.grad is None:
        raise RuntimeError("the parameter has no .grad")
    return param.grad.detach()


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


def save_figure(fig: Any, path: Any, rect: tuple[float, float, float, float] | None = None
                ) -> None:
    """Lay out ``fig`` (its axes inside ``rect``, figure fractions, when given), write it to
    ``path`` as a 100 dpi PNG and free it."""
    fig.tight_layout(rect=rect)
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
            grad = grad_of(self.weights).clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
            now = self.weights.detach()
            delta = before - now
            out["step"].append(float(delta.norm()))
            out["update"].append(float(stats.update_norm or 0.0))
            out["tilt"].append(angle_deg(delta, grad))
            if t % record_every == 0 or t == steps - 1:
                out["x"].append(float(now[0]))
                out["y"].append(float(now[1]))
                out["pareto"].append(self.pareto_distance(now))
        return out


# -- many two-bowl runs at once ---------------------------------------------------------------
#
# The figures that need thousands of two-bowl steps (several seeds, starts or readings) run them
# as one batch: the weights are a ``[B, 2]`` parameter, the exact gradients come in closed form,
# two-task PCGrad and MGDA are the library's own closed forms written over a batch dimension
# (``pcgrad_two``, ``mgda_two``), and the ``torch.optim`` step is elementwise, so each row is an
# independent run. Every figure that uses them checks them against the library: the balancers on
# the matrices the figure met (:func:`kernel_gap`) and :meth:`TwoBowls.train` over a prefix of the
# same runs; both numbers are reported beside the claims.


_CENTERS = torch.tensor(BOWL_CENTERS, dtype=torch.float64)
_CURVATURE = torch.tensor(BOWL_CURVATURE, dtype=torch.float64)


def bowl_gradients(w: Tensor) -> Tensor:
    """Exact task gradients ``[..., 2, 2]`` (task, coordinate) at the float64 weights
    ``[..., 2]``."""
    return (w.unsqueeze(-2) - _CENTERS) * _CURVATURE


def bowl_noise(seed: int, steps: int, sigma: float = 1.0) -> Tensor:
    """``[steps, 2, 2]``: the gradient noise :class:`TwoBowls` ``(noise=sigma, seed=seed)`` adds
    over ``steps`` steps (same generator, same draws, same order)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randn(2, 2, generator=gen, dtype=torch.float64) * sigma
                        for _ in range(steps)])


def _gram(matrix: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(‖g₁‖², ‖g₂‖², g₁·g₂)`` of ``[..., 2, P]``, each ``[..., 1]``."""
    gram = matrix @ matrix.transpose(-1, -2)
    return gram[..., 0, :1], gram[..., 1, 1:], gram[..., 0, 1:]


def pcgrad_two(matrix: Tensor) -> Tensor:
    """The ``PCGrad`` balancer (sum reduction) on two tasks, over a batch: ``[..., 2, P]`` →
    ``[..., P]``. When ``g₁·g₂ < 0`` each row loses its component along the other,
    ``g₁ + g₂ − (g₁·g₂/‖g₂‖²) g₂ − (g₁·g₂/‖g₁‖²) g₁``; with two tasks the visiting order
    does not matter, and a zero row is never projected on (its dot product is 0), as in
    :func:`gradbalance.functional.pcgrad_coefficients`."""
    n1, n2, dot = _gram(matrix)
    c = dot.clamp(max=0.0)
    tiny = torch.finfo(matrix.dtype).tiny
    w1 = 1 - c / n1.clamp_min(tiny)
    w2 = 1 - c / n2.clamp_min(tiny)
    out: Tensor = w1 * matrix[..., 0, :] + w2 * matrix[..., 1, :]
    return out


def mgda_two(matrix: Tensor) -> Tensor:
    """The ``MGDA`` balancer (no normalisation) on two tasks, over a batch: ``[..., 2, P]`` →
    ``[..., P]``. The min-norm point ``γ g₁ + (1 − γ) g₂`` with
    ``γ = clip((‖g₂‖² − g₁·g₂) / ‖g₁ − g₂‖², 0, 1)``, the closed form the library's solver
    uses for K = 2 (Sener & Koltun 2018, Alg. 1); for equal rows every γ gives the same
    point."""
    n1, n2, dot = _gram(matrix)
    diff = (n1 - 2 * dot + n2).clamp_min(torch.finfo(matrix.dtype).tiny)
    gamma = ((n2 - dot) / diff).clamp(0.0, 1.0)
    out: Tensor = gamma * matrix[..., 0, :] + (1 - gamma) * matrix[..., 1, :]
    return out


#: balancer name -> its batched two-task form.
KERNELS: dict[str, Callable[[Tensor], Tensor]] = {
    "pcgrad": pcgrad_two,
    "mgda": mgda_two,
    "sum": lambda matrix: matrix.sum(dim=-2),
    "mean": lambda matrix: matrix.mean(dim=-2),
}


def kernel_gap(name: str, matrices: Tensor, samples: int = 200) -> float:
    """Largest difference ``‖kernel(G) − balancer(G)‖ / ‖G‖`` between the batched form of
    balancer ``name`` and the library's balancer, over ``samples`` of the ``[..., 2, P]``
    ``matrices`` (evenly spaced through them): rounding is about 1e-16."""
    flat = matrices.reshape(-1, 2, matrices.shape[-1])
    pick = torch.linspace(0, flat.shape[0] - 1, min(samples, flat.shape[0])).round().long()
    balancer = require_balancer(name)
    kernel = KERNELS[name]
    worst = 0.0
    for i in pick.tolist():
        scale = float(flat[i].norm())
        if scale > 0:
            worst = max(worst, float((kernel(flat[i]) - balancer(flat[i])).norm()) / scale)
    return worst


def train_bowls(
    starts: Tensor,
    balancer: str,
    make_optimizer: Callable[[list[Tensor]], torch.optim.Optimizer],
    steps: int,
    noise: Tensor | None = None,
    until_still: bool = False,
) -> dict[str, Tensor]:
    """Run ``B`` independent two-bowl trainings at once: ``starts`` ``[B, 2]``.

    Per step: the exact task gradients plus ``noise[:, t]`` (``[B, steps, 2, 2]``, or None),
    the batched balancer ``balancer`` (:data:`KERNELS`) into ``.grad``, then one step of the
    optimizer ``make_optimizer`` builds (elementwise in torch, so the rows never mix).
    ``until_still``: stop once a step leaves every weight bitwise unchanged while the balanced
    gradient is exactly zero (or, for plain SGD, whose only state is the weights, once a step
    leaves them unchanged): every later step is then zero too, since with a zero gradient the
    steps of SGD, heavy ball and Adam only shrink. ``steps_run`` says how many were taken.

    Returns ``path`` ``[n + 1, B, 2]`` (the start, then the weights after each step),
    ``handed`` ``[n, B, 2]`` (the balanced gradient written into ``.grad``) and
    ``matrices`` ``[n, B, 2, 2]`` (the task gradients it was balanced from).
    """
    kernel = KERNELS[balancer]
    weights = torch.nn.Parameter(starts.detach().clone().double())
    opt = make_optimizer([weights])
    b = starts.shape[0]
    path = torch.empty(steps + 1, b, 2, dtype=torch.float64)
    handed = torch.empty(steps, b, 2, dtype=torch.float64)
    matrices = torch.empty(steps, b, 2, 2, dtype=torch.float64)
    path[0] = weights.detach()
    stateless = isinstance(opt, torch.optim.SGD) and all(
        g["momentum"] == 0 and g["weight_decay"] == 0 for g in opt.param_groups)
    n = steps
    for t in range(steps):
        with torch.no_grad():
            grads = bowl_gradients(weights.detach())
            if noise is not None:
                grads = grads + noise[:, t]
            matrices[t] = grads
            handed[t] = kernel(grads)
        weights.grad = handed[t].clone()
        opt.step()
        path[t + 1] = weights.detach()
        if until_still and torch.equal(path[t + 1], path[t]) and (
                stateless or not bool(handed[t].any())):
            n = t + 1
            break
    return {"path": path[: n + 1], "handed": handed[:n], "matrices": matrices[:n],
            "steps_run": torch.tensor(n)}


def pareto_distances(w: Tensor) -> Tensor:
    """:meth:`TwoBowls.pareto_distance` over a batch: ``[..., 2]`` → ``[...]``."""
    c1, c2 = _CENTERS[0], _CENTERS[1]
    d = c2 - c1
    t = (((w.double() - c1) @ d) / (d @ d)).clamp(0.0, 1.0)
    out: Tensor = (w.double() - (c1 + t.unsqueeze(-1) * d)).norm(dim=-1)
    return out


def angles_deg(a: Tensor, b: Tensor) -> Tensor:
    """Angles (degrees) between the vectors in the last dimension of ``a`` and ``b`` (0 where
    either is zero)."""
    den = a.norm(dim=-1) * b.norm(dim=-1)
    cos = torch.where(den > 0, (a * b).sum(-1) / torch.where(den > 0, den, 1.0), 1.0)
    return torch.rad2deg(torch.acos(cos.clamp(-1.0, 1.0)))


def seed_range(values: list[float], text: float, rounding: float = 0.5) -> tuple[float, float,
                                                                                  bool]:
    """``(min, max, met)`` of per-seed values; met when that range overlaps the text's number
    as the text rounds it (``text ± rounding``)."""
    lo, hi = min(values), max(values)
    return lo, hi, lo <= text + rounding and hi >= text - rounding


def mean_se(values: list[float]) -> tuple[float, float]:
    """Mean of per-seed values and its standard error (sample standard deviation / √n)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(var / len(values))
