"""Where one ``batch_dim=0`` step goes: its phases timed, the plain mean-loss step alongside.

Per round: one plain step, then one step of ``TaskGradBuffer(..., batch_dim=0)`` with the
phases timed by wrapping the route's functions: the forward, the Gramian's backward (the
per-column ``autograd.grad``, with the layers' forms contracted in its hooks, also shown
alone), the weights (``compute_weights``) and the update (``apply_``'s weighted gradients).
Medians over the rounds after one warm-up round, one thread. Run it with base and head on
``PYTHONPATH`` alternately to compare them (docs/performance.md, "Per-sample objectives").

    python benchmarks/per_sample_phases.py --model transformer --batch 256 --rounds 5
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import statistics
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

import gradbalance._per_sample_gramian as gramian_module
import gradbalance._per_sample_step as step_module
from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, UPGrad
from gradbalance.balancers._base import Balancer
from per_sample_models import MODELS

SPENT: dict[str, float] = {}


def _timed(owner: Any, name: str, key: str) -> None:
    """Wrap ``owner.name`` so that its time adds to ``SPENT[key]``."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            SPENT[key] = SPENT.get(key, 0.0) + time.perf_counter() - start

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", default="transformer", choices=sorted(MODELS[False]))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--balancer", default="mgda", choices=["mgda", "upgrad"])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _timed(gramian_module.PerSampleGramian, "passes", "gramian backward")
    _timed(gramian_module.PerSampleGramian, "_contract", "of which forms")
    _timed(Balancer, "compute_weights", "weights")
    _timed(step_module, "weighted_grads", "update")
    build, inputs = MODELS[False][args.model]
    torch.manual_seed(0)
    base = build()
    gen = torch.Generator().manual_seed(1)
    x, y = inputs(args.batch, gen), torch.randn(args.batch, generator=gen)
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    buf = TaskGradBuffer(ours.parameters(), modules=ours, batch_dim=0)
    balancer = UPGrad() if args.balancer == "upgrad" else MGDA()
    rows: dict[str, list[float]] = {}
    for r in range(args.rounds + 1):
        start = time.perf_counter()
        ((plain(x)[:, 0] - y) ** 2).mean().backward()
        plain.zero_grad(set_to_none=True)
        plain_s = time.perf_counter() - start
        SPENT.clear()
        start = time.perf_counter()
        losses = (ours(x)[:, 0] - y) ** 2
        SPENT["forward"] = time.perf_counter() - start
        buf.backward(losses)
        buf.apply_(balancer)
        ours.zero_grad(set_to_none=True)
        step_s = time.perf_counter() - start
        if r:  # round 0 warms up
            for key, value in {"plain": plain_s, "step": step_s, "step / plain":
                               step_s / plain_s, **SPENT}.items():
                rows.setdefault(key, []).append(value)
    print(f"{args.model} B={args.batch} {args.balancer}, medians of {args.rounds} rounds (s): "
          + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in rows.items()))


if __name__ == "__main__":
    main()
