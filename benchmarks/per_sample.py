"""Instance-wise balancing (``batch_dim=0``): the step against the plain mean-loss step and
TorchJD 0.18's autogram engine, on an MLP, a CNN and a small transformer
(``benchmarks/per_sample_models.py``), with the same weighting (MGDA, UPGrad).

Every variant has its own copy of the model (hooks do not cross). Per round each variant runs
one step, interleaved; the table gives the median over rounds of the step time and of its ratio
to the plain step of the same round (one thread). Variants:

* plain: ``losses.mean().backward()``;
* gradbalance: ``TaskGradBuffer(params, modules=model, batch_dim=0)``, ``backward(losses)``,
  ``apply_(balancer)`` (docs/per_sample.md);
* torchjd: ``Engine(model, batch_dim=0)``, ``compute_gramian(losses)``, the weighting,
  ``losses.backward(weights)``.

Peak memory: one more step of each variant (MGDA) under ``torch.profiler`` with
``profile_memory=True``; its memory timeline lists every CPU allocation and free of the step,
and the peak is the largest sum of the bytes allocated during the step and still alive
(tensors that existed before the step, the parameters and the input, are not counted).

    python benchmarks/per_sample.py                     # ≈ 50 min on a shared 2-core machine
    python benchmarks/per_sample.py --models mlp --batches 16 --rounds 3
    python benchmarks/per_sample.py --quick             # smoke run, tiny models, seconds
    python benchmarks/per_sample.py --tasks 3           # [B, 3] losses: B·3 objectives
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
from per_sample_models import MODELS

Step = Callable[[Tensor, Tensor], None]
MiB = 2.0**20


def _losses(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """``[B]`` (``y`` ``[B]``) or ``[B, K]`` (``y`` ``[B, K]``, the model's K outputs)
    per-sample losses, reduction='none'."""
    out = model(x)
    return (out[:, 0] - y) ** 2 if y.dim() == 1 else (out - y) ** 2


def plain_step(model: nn.Module, balancer: str) -> Step:
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


def torchjd_step(model: nn.Module, balancer: str) -> Step:
    from torchjd.aggregation import MGDAWeighting, UPGradWeighting
    from torchjd.autogram import Engine

    engine = Engine(model, batch_dim=0)
    weighting = UPGradWeighting() if balancer == "upgrad" else MGDAWeighting()

    def step(x: Tensor, y: Tensor) -> None:
        losses = _losses(model, x, y)
        weights = weighting(engine.compute_gramian(losses))  # [B·K, B·K]: (i, k) at i·K + k
        losses.backward(weights.reshape(losses.shape))
        model.zero_grad(set_to_none=True)
    return step


def _variants() -> dict[str, Callable[[nn.Module, str], Step]]:
    variants = {"plain": plain_step, "gradbalance": ours_step}
    try:
        import torchjd  # noqa: F401
    except ImportError:
        print("torchjd is not installed: no torchjd column", file=sys.stderr)
    else:
        variants["torchjd"] = torchjd_step
    return variants


def _steps(name: str, batch: int, balancer: str, quick: bool,
           tasks: int = 1) -> tuple[dict[str, Step], Tensor, Tensor, int]:
    build, inputs = MODELS[quick][name]
    torch.manual_seed(0)
    base = build(tasks)
    steps = {v: make(copy.deepcopy(base), balancer) for v, make in _variants().items()}
    gen = torch.Generator().manual_seed(1)
    x = inputs(batch, gen)
    y = torch.randn(batch, *([tasks] if tasks > 1 else []), generator=gen)
    return steps, x, y, sum(p.numel() for p in base.parameters())


#: The clock of :func:`_time`: wall time, or this process's CPU time (``--clock cpu``: on a
#: shared machine, what the step itself costs).
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def _time(step: Step, x: Tensor, y: Tensor) -> float:
    start = _clock()
    step(x, y)
    return (_clock() - start) * 1e3


def timing(name: str, batch: int, balancer: str, rounds: int, warmup: int,
           quick: bool, tasks: int = 1) -> dict[str, float]:
    """Medians of the step times and of the per-round ratios to the plain step."""
    steps, x, y, _ = _steps(name, batch, balancer, quick, tasks)
    for _ in range(warmup):
        for step in steps.values():
            step(x, y)
    times: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(rounds):
        for v, step in steps.items():
            times[v].append(_time(step, x, y))
    result = {f"{v}_ms": statistics.median(t) for v, t in times.items()}
    for v in steps:
        result[f"{v}_x"] = statistics.median(a / p for a, p in zip(times[v], times["plain"]))
    if "torchjd" in steps:
        result["ours_over_torchjd"] = statistics.median(
            a / t for a, t in zip(times["gradbalance"], times["torchjd"]))
    return result


def peak_bytes(step: Step, x: Tensor, y: Tensor) -> int:
    """The peak of the bytes allocated during ``step(x, y)`` and still alive (CPU), from
    ``torch.profiler``'s memory timeline."""
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import Action

    step(x, y)  # warm: lazily built state is not the step's
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step(x, y)
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        if action == Action.CREATE:
            live += size
        elif action == Action.DESTROY:
            live -= size
        peak = max(peak, live)
    return peak


def memory(name: str, batch: int, quick: bool) -> dict[str, float]:
    """Peak MiB of one MGDA step of every variant, and the model's size P."""
    steps, x, y, params = _steps(name, batch, "mgda", quick)
    result = {f"{v}_mib": peak_bytes(step, x, y) / MiB for v, step in steps.items()}
    return {**result, "params": float(params)}


def _fmt(r: dict[str, float], key: str, spec: str) -> str:
    return format(r[key], spec) if key in r else "–"


def _time_row(name: str, balancer: str, batch: int, r: dict[str, float]) -> str:
    return (f"| {name} | {balancer} | {batch} | {r['plain_ms']:.1f} | {r['gradbalance_ms']:.1f} "
            f"| {r['gradbalance_x']:.2f} | {_fmt(r, 'torchjd_ms', '.1f')} | "
            f"{_fmt(r, 'torchjd_x', '.2f')} | {_fmt(r, 'ours_over_torchjd', '.3f')} |")


def _memory_row(name: str, batch: int, r: dict[str, float]) -> str:
    bp = batch * r["params"] * 4 / MiB
    return (f"| {name} | {batch} | {int(r['params']):,} | {r['plain_mib']:.2f} | "
            f"{r['gradbalance_mib']:.2f} | {_fmt(r, 'torchjd_mib', '.2f')} | "
            f"{batch * batch * 4 / MiB:.3f} | {bp:.1f} |")


TIME_HEAD = ("| model | balancer | B | plain ms | gradbalance ms | gradbalance / plain | "
             "torchjd ms | torchjd / plain | gradbalance / torchjd |\n"
             "|---|---|---|---|---|---|---|---|---|\n")
MEMORY_HEAD = ("| model | B | P | plain MiB | gradbalance MiB | torchjd MiB | B² fp32 MiB | "
               "B·P fp32 MiB |\n|---|---|---|---|---|---|---|---|\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn,transformer")
    parser.add_argument("--batches", default=None, help="default 16,64,256 (--quick: 4,8)")
    parser.add_argument("--balancers", default="mgda,upgrad")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=1,
                        help="K: [B, K] losses (the models' K outputs) when above 1")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory table")
    parser.add_argument("--quick", action="store_true",
                        help="tiny models, B = 4, 8: a smoke run (per_sample_cpu-quick.md)")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                        help="wall time (default) or the process's CPU time")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    global _clock
    _clock = CLOCK[args.clock]
    models = [m for m in args.models.split(",") if m]
    batches = [int(b) for b in (args.batches or ("4,8" if args.quick else "16,64,256"))
               .split(",") if b]
    times, mems = [], []
    for name in models:
        for balancer in args.balancers.split(","):
            for batch in batches:
                r = timing(name, batch, balancer, args.rounds, args.warmup, args.quick,
                           args.tasks)
                label = name if args.tasks == 1 else f"{name} [B, {args.tasks}]"
                times.append(_time_row(label, balancer, batch, r))
                print(times[-1], file=sys.stderr, flush=True)
        for batch in [] if args.no_memory else batches:
            mems.append(_memory_row(name, batch, memory(name, batch, args.quick)))
            print(mems[-1], file=sys.stderr, flush=True)
    text = (f"## Per-sample objectives (batch_dim=0), CPU, 1 thread, torch {torch.__version__}"
            f"{' (quick)' if args.quick else ''}\n\n"
            f"Step time ({args.clock} clock): median of {args.rounds} interleaved rounds after "
            f"{args.warmup} warm-up "
            "step(s); ratios are per round to the plain mean-loss step.\n\n" + TIME_HEAD
            + "\n".join(times) + "\n")
    if mems:
        text += ("\nPeak memory of one MGDA step (torch.profiler memory timeline: bytes "
                 "allocated during the step and alive at once).\n\n" + MEMORY_HEAD
                 + "\n".join(mems) + "\n")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = "per_sample_cpu-quick.md" if args.quick else "per_sample_cpu.md"
    (Path(args.out) / name).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
