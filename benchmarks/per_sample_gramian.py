"""UPGrad, DualProj and MGDA on the per-sample Gramians of ``per_sample.py``'s models.

One step of each model (``per_sample_models.py``) at batch size B with ``batch_dim=0`` hands
the balancer a ``[B, B]`` Gramian (the transformer's is positive definite with a condition
number near 1e12, the CNN's near 1e7); this records it, then times each method's weights on
it (median of ``--rounds``, one thread) next to its condition number. Run it with base and head
on ``PYTHONPATH`` alternately to compare solvers on the same Gramian.

    python benchmarks/per_sample_gramian.py --models transformer,cnn --batch 256
    python benchmarks/per_sample_gramian.py --models mlp --save /tmp/grams  # keeps mlp256.pt

Results: ``docs/performance.md`` ("Per-sample objectives"),
``benchmarks/results/per_sample_cpu.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from torch import Tensor

from gradbalance import TaskGradBuffer
from gradbalance.balancers import UPGrad
from gradbalance.functional import dualproj_weights, mgda_weights, upgrad_weights
from per_sample_models import MODELS


class _Recorder(UPGrad):
    """Keeps the Gramian it is handed and returns equal weights (no solve)."""

    gramian: Tensor | None = None

    def _compute_weights(self, gramian: Tensor, losses: Tensor | None = None) -> Tensor:
        type(self).gramian = gramian.detach().clone()
        return torch.full((gramian.shape[0],), 1.0 / gramian.shape[0], dtype=torch.float64)


def per_sample_gramian(name: str, batch: int) -> Tensor:
    """The Gramian one ``batch_dim=0`` step of the model hands its balancer."""
    build, inputs = MODELS[False][name]
    torch.manual_seed(0)
    model = build()
    gen = torch.Generator().manual_seed(1)
    x, y = inputs(batch, gen), torch.randn(batch, generator=gen)
    buf = TaskGradBuffer(model.parameters(), modules=model, batch_dim=0)
    buf.backward((model(x)[:, 0] - y) ** 2)
    buf.apply_(_Recorder())
    assert _Recorder.gramian is not None
    return _Recorder.gramian.to(torch.float64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="transformer,cnn")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default="upgrad,dualproj,mgda")
    parser.add_argument("--save", default=None,
                        help="folder to save each Gramian in (torch.save, <model><B>.pt)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rules = {"upgrad": upgrad_weights, "dualproj": dualproj_weights, "mgda": mgda_weights}
    for name in args.models.split(","):
        gram = per_sample_gramian(name, args.batch)
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            torch.save(gram, Path(args.save) / f"{name}{args.batch}.pt")
        lam, diag = torch.linalg.eigvalsh(gram), torch.diagonal(gram)
        print(f"{name} B={args.batch}: condition number {float(lam[-1] / lam[0]):.2e}, "
              f"diagonal span {float(diag.max() / diag.min()):.2e}")
        for method in args.methods.split(","):
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                rules[method](gram)
                times.append(time.perf_counter() - start)
            print(f"  {method}: {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
