"""UPGrad, DualProj and MGDA on the per-sample Gramians of ``per_sample.py``'s models.

One step of each model (``per_sample_models.py``) at batch size B with ``batch_dim=0`` hands
the balancer a ``[B, B]`` Gramian (the transformer's is positive definite with a condition
number near 1e12, the CNN's near 1e7); this records it, then times each method's weights on
it (median of ``--rounds``, one thread) next to its condition number. Run it with base and head
on ``PYTHONPATH`` alternately to compare solvers on the same Gramian.

    python benchmarks/per_sample_gramian.py --models transformer,cnn --batch 256
    python benchmarks/per_sample_gramian.py --models mlp --save /tmp/grams  # keeps mlp256.pt
    python benchmarks/per_sample_gramian.py --models transformer --batch 64 --tasks 4

``--tasks T``: ``[B, T]`` losses ``(f(x) − y_k)²`` from the one output, whose gradients
``2(f(x) − y_k)∇f`` are parallel per sample: the ``[B·T, B·T]`` Gramian of float32 rows
``cᵢ h_{b(i)}`` over the recorded ``S`` (rank ``B`` up to its rounding; :func:`parallel_blocks`).

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
from gradbalance.gramian import compute_gramian
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


def parallel_blocks(gram: Tensor, tasks: int, seed: int = 0, p: int = 4096) -> Tensor:
    """``[B·T, B·T]``: the Gramian (:func:`~gradbalance.gramian.compute_gramian`, multiplied in
    float32 as a step's is) of float32 rows ``cᵢ h_{b(i)}``, each sample's ``T`` rows parallel
    (or opposed) with norms ``|cᵢ| ∈ 1e-1 … 1e1``; the ``hᵦ`` ``[P]`` have the Gramian ``S``
    (its eigen-factor, negative eigenvalues dropped, in a random ``P``-dimensional basis)."""
    b = gram.shape[0]
    gen = torch.Generator().manual_seed(seed)
    lam, vec = torch.linalg.eigh(gram)
    basis = torch.linalg.qr(torch.randn(p, b, generator=gen, dtype=torch.float64))[0]
    h = (vec * lam.clamp_min(0.0).sqrt()) @ basis.T
    c = torch.rand(b, tasks, generator=gen, dtype=torch.float64)
    c = c * torch.logspace(-1, 1, tasks, dtype=torch.float64)
    c = torch.where(torch.rand(b, tasks, generator=gen) < 1 / 3, -c, c)
    rows = (c[:, :, None] * h[:, None, :]).reshape(b * tasks, p)
    return compute_gramian(rows.to(torch.float32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", default="transformer,cnn")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default="upgrad,dualproj,mgda")
    parser.add_argument("--tasks", type=int, default=1, help="T parallel losses per sample")
    parser.add_argument("--save", default=None,
                        help="folder to save each Gramian in (torch.save, <model><B>.pt)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rules = {"upgrad": upgrad_weights, "dualproj": dualproj_weights, "mgda": mgda_weights}
    for name in args.models.split(","):
        gram = per_sample_gramian(name, args.batch)
        if args.tasks > 1:
            gram = parallel_blocks(gram, args.tasks)
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            torch.save(gram, Path(args.save) / f"{name}{args.batch}.pt")
        lam, diag = torch.linalg.eigvalsh(gram), torch.diagonal(gram)
        print(f"{name} B={args.batch} T={args.tasks}: condition number "
              f"{float(lam[-1] / lam[0]):.2e}, diagonal span {float(diag.max() / diag.min()):.2e}")
        for method in args.methods.split(","):
            times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                rules[method](gram)
                times.append(time.perf_counter() - start)
            print(f"  {method}: {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
