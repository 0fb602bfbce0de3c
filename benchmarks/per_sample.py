"""Instance-wise balancing (``batch_dim=0``): the step against the plain mean-loss step and
TorchJD 0.18's autogram engine, on an MLP 128→768→768→1.

Every variant has its own copy of the model (hooks do not cross). Per round each variant runs
one step, interleaved; the table gives the median over rounds of the step time and of its ratio
to the plain step of the same round (one thread). Variants, all with the same weighting:

* plain: ``loss.mean().backward()``;
* gradbalance: ``TaskGradBuffer(params, modules=model, batch_dim=0)``, ``backward(losses)``,
  ``apply_(balancer)`` (docs/per_sample.md);
* torchjd: ``Engine(model, batch_dim=0)``, ``compute_gramian(losses)``, the weighting,
  ``losses.backward(weights)``.

    python benchmarks/per_sample.py                     # ≈ 3 min
    python benchmarks/per_sample.py --batches 16 --rounds 3
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from torch import Tensor, nn

from gradbalance import TaskGradBuffer
from gradbalance.balancers import MGDA, UPGrad

Step = Callable[[Tensor, Tensor], None]


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(128, 768), nn.ReLU(), nn.Linear(768, 768), nn.ReLU(),
                         nn.Linear(768, 1))


def _losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return (model(x)[:, 0] - y) ** 2  # [B], reduction='none'


def plain_step(model: nn.Module) -> Step:
    def step(x: Tensor, y: Tensor) -> None:
        _losses(model, x, y).mean().backward()
        model.zero_grad(set_to_none=True)
    return step


def ours_step(model: nn.Module, balancer: str) -> Step:
    buf = TaskGradBuffer(model.parameters(), modules=model, batch_dim=0)
    chosen = UPGrad() if balancer == "upgrad" else MGDA()

    def step(x: Tensor, y: Tensor) -> None:
        buf.backward(_losses(model, x, y))
        buf.apply_(chosen)
        model.zero_grad(set_to_none=True)
    return step


def torchjd_step(model: nn.Module, balancer: str) -> Step | None:
    try:
        from torchjd.aggregation import MGDAWeighting, UPGradWeighting
        from torchjd.autogram import Engine
    except ImportError:
        return None
    engine = Engine(model, batch_dim=0)
    weighting = UPGradWeighting() if balancer == "upgrad" else MGDAWeighting()

    def step(x: Tensor, y: Tensor) -> None:
        losses = _losses(model, x, y)
        weights = weighting(engine.compute_gramian(losses))
        losses.backward(weights)
        model.zero_grad(set_to_none=True)
    return step


def _time(step: Step, x: Tensor, y: Tensor) -> float:
    start = time.perf_counter()
    step(x, y)
    return (time.perf_counter() - start) * 1e3


def run(batch: int, balancer: str, rounds: int, warmup: int) -> dict[str, float]:
    torch.manual_seed(0)
    base = _mlp()
    steps: dict[str, Step] = {"plain": plain_step(copy.deepcopy(base)),
                              "gradbalance": ours_step(copy.deepcopy(base), balancer)}
    jd = torchjd_step(copy.deepcopy(base), balancer)
    if jd is not None:
        steps["torchjd"] = jd
    x, y = torch.randn(batch, 128), torch.randn(batch)
    for _ in range(warmup):
        for step in steps.values():
            step(x, y)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            times[name].append(_time(step, x, y))
    result = {f"{name}_ms": statistics.median(t) for name, t in times.items()}
    for name in steps:
        if name != "plain":
            result[f"{name}_x"] = statistics.median(
                a / p for a, p in zip(times[name], times["plain"]))
    if "torchjd_ms" in result:
        result["ours_over_torchjd"] = statistics.median(
            a / t for a, t in zip(times["gradbalance"], times["torchjd"]))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="16,64,256")
    parser.add_argument("--balancers", default="upgrad,mgda")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for balancer in args.balancers.split(","):
        for batch in [int(b) for b in args.batches.split(",") if b]:
            r = run(batch, balancer, args.rounds, args.warmup)
            rows.append(
                f"| {balancer} | {batch} | {r['plain_ms']:.1f} | {r['gradbalance_ms']:.1f} | "
                f"{r['gradbalance_x']:.2f} | {r.get('torchjd_ms', float('nan')):.1f} | "
                f"{r.get('torchjd_x', float('nan')):.2f} | "
                f"{r.get('ours_over_torchjd', float('nan')):.2f} |")
            print(rows[-1], file=sys.stderr)
    text = ("## Per-sample objectives (batch_dim=0), MLP 128→768→768→1, CPU, 1 thread\n\n"
            f"Median of {args.rounds} interleaved rounds after {args.warmup} warm-up steps; "
            "ratios are per round to the plain mean-loss step.\n\n"
            "| balancer | B | plain ms | gradbalance ms | gradbalance / plain | torchjd ms | "
            "torchjd / plain | gradbalance / torchjd |\n|---|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "per_sample_cpu.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
