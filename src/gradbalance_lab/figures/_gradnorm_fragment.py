"""§9.1's fragment, run: ``L_grad`` trains only ``w``, and the rescale inside ``no_grad`` is
not trained.

The case: K = 3 weights ``w`` (ones, float64) and one network weight ``θ ∈ R³``;
``L_grad = Σₖ |wₖ nₖ − tₖ|`` with ``nₖ = ‖aₖ ⊙ θ‖`` (so it depends on the network too) and
fixed targets ``tₖ``. The fragment runs as the text writes it: ``L_grad.backward(inputs=[w])``,
``opt_w.step()`` (Adam, lr 0.025), ``opt_w.zero_grad()``, then ``w.mul_(K / w.sum())`` inside
``no_grad``. Measured: ``θ.grad`` after the backward (None: only ``w`` is trained); ``w`` after
the rescale (a leaf without ``grad_fn``, summing to K); the next ``L_grad``'s gradient in ``w``
against its closed form at the rescaled ``w``, ``sign(wₖ nₖ − tₖ) nₖ`` (the rescale is not
differentiated through), and against the rescale written into the graph instead,
``w ↦ K w / Σw``, whose gradient ``∇ − 1 (w·∇)/K`` (at ``Σw = K``) is orthogonal to ``w``.
The library's :class:`~gradbalance.weighting.GradNorm` runs the same three lines in its
update; its weights after an update are checked to be a leaf without ``grad_fn``, and the
network's ``.grad`` to be bitwise unchanged by the update.
"""

from __future__ import annotations

from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import require_attr
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

K = 3
F64 = torch.float64
_A = torch.tensor([[1.0, 0.5, 2.0], [0.3, 1.0, -1.0], [2.0, -0.5, 0.25]], dtype=F64)
_TARGETS = torch.tensor([1.0, 2.0, 0.5], dtype=F64)


def _l_grad(w: torch.Tensor, theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    norms = (_A * theta).norm(dim=1)
    return (w * norms - _TARGETS).abs().sum(), norms


def text_fragment() -> dict[str, Any]:
    """The fragment's three lines on the case above, then the next step's gradient in ``w``."""
    theta = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=F64))
    w = torch.ones(K, dtype=F64, requires_grad=True)
    opt_w = torch.optim.Adam([w], lr=0.025)
    loss, _ = _l_grad(w, theta)
    loss.backward(inputs=[w])
    only_w = theta.grad is None and w.grad is not None
    opt_w.step()
    opt_w.zero_grad()
    with torch.no_grad():
        w.mul_(K / w.sum())
    loss, norms = _l_grad(w, theta)
    (grad,) = torch.autograd.grad(loss, w)
    n, wd = norms.detach(), w.detach()
    closed = torch.sign(wd * n - _TARGETS) * n
    in_graph, _ = _l_grad(K * w / w.sum(), theta)
    (grad_in,) = torch.autograd.grad(in_graph, w)
    return {"only_w": only_w, "leaf": w.is_leaf and w.grad_fn is None,
            "sum_gap": abs(float(w.detach().sum()) - K),
            "closed_gap": float((grad - closed).abs().max()),
            "in_graph_gap": float((grad - grad_in).abs().max()),
            "in_graph_closed_gap": float((grad_in - (closed - closed @ wd / K)).abs().max()),
            "in_graph_dot": float(grad_in @ wd)}


def library_update() -> dict[str, Any]:
    """One step of the library's GradNorm on a small model: its weights after ``update()``
    and the network's ``.grad`` across it."""
    gradnorm_cls = require_attr("weighting", "GradNorm")
    torch.manual_seed(0)
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, K))
    x, y = torch.randn(32, 8), torch.randn(32, K)
    weighting = gradnorm_cls(K, model.trunk)
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters())
    buf.backward(weighting(regression_losses(model(x), y)))
    buf.apply_(get_balancer("sum"))
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    weighting.update()
    after = [p.grad for p in model.parameters() if p.grad is not None]
    w = weighting.task_weights
    return {"leaf": w.is_leaf and w.grad_fn is None, "sum_gap": abs(float(w.detach().sum()) - K),
            "grad_same": len(after) == len(grads) > 0
            and all(torch.equal(a, b) for a, b in zip(grads, after))}
