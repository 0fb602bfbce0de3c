"""torch.compile under the balanced step: step time, eager against compiled, in plain steps.

Variants, each on its own copy of the same model (K heads, MSE losses), interleaved in one
process (the order rotates every round), after a warm-up that also pays the compilation:

* ``plain`` — ``sum(losses).backward()`` + ``optimizer.step()``, eager: the unit;
* ``plain-compiled`` — the same step on ``torch.compile(model)``;
* ``balanced`` — ``TaskGradBuffer`` (matrix mode) + UPGrad, eager;
* ``balanced-compiled-trunk`` — the same with ``model.trunk = torch.compile(model.trunk)``;
* ``balanced-compiled-model`` — the same on ``torch.compile(model)`` (heads inside the graph).

The process runs with ``torch._functorch.config.donated_buffer = False``: copies of one model
class share their compiled graphs, and a backward whose first run (``plain-compiled``) does
not retain the graph is compiled with donated buffers, which the balanced step's K + 1 passes
(``retain_graph=True``) then refuse. For the same reason ``balanced-compiled-model``'s first
step reuses the graph compiled for ``plain-compiled``.

Times are the process's CPU time by default (``--clock process``: with one thread it is the
step's own work, little moved by other processes on a shared machine; ``--clock wall`` for
elapsed time). The figure is the median over rounds of ``t_variant / t_plain`` measured in the
same round
(with its interquartile range); milliseconds are medians too; "/ same variant eager" divides
a balanced variant's median by the eager balanced step's. Also printed: the first
(compiling) step's wall time and ``torch._dynamo.explain``'s graph and graph-break counts for
the forward.

    python benchmarks/compile_step.py                 # -> results/compile_step.txt
    python benchmarks/compile_step.py --quick --backend aot_eager --out /tmp/x   # smoke run
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

import torch
import torch._functorch.config
from torch import Tensor, nn

import gradbalance as gb
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, transformer_trunk

Step = Callable[[], None]

TRUNKS = {
    # name: (trunk builder, feature width, input shape); as in step_overhead.py
    "mlp": (lambda: mlp_trunk(256, 512, 3), 512, (256, 256)),
    "transformer-narrow": (lambda: transformer_trunk(128, 2, 4), 128, (32, 64, 128)),
}
QUICK_TRUNKS = {
    "mlp": (lambda: mlp_trunk(32, 64, 3), 64, (16, 32)),
    "transformer-narrow": (lambda: transformer_trunk(16, 2, 2), 16, (4, 8, 16)),
}
VARIANTS = ("plain", "plain-compiled", "balanced", "balanced-compiled-trunk",
            "balanced-compiled-model")


def _losses(outputs: list[Tensor], y: Tensor) -> Tensor:
    return torch.stack([nn.functional.mse_loss(o.squeeze(-1), y[:, k])
                        for k, o in enumerate(outputs)])


def _variant(name: str, base: MultiTaskModel, x: Tensor, y: Tensor, backend: str,
             balancer: str) -> Step:
    model = copy.deepcopy(base)
    forward: nn.Module = model
    if name.endswith("compiled-model") or name == "plain-compiled":
        forward = torch.compile(model, backend=backend)
    elif name.endswith("compiled-trunk"):
        model.trunk = torch.compile(model.trunk, backend=backend)  # type: ignore[assignment]
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if name.startswith("plain"):
        def plain() -> None:
            _losses(forward(x), y).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return plain
    buf = gb.TaskGradBuffer(list(model.trunk.parameters()), list(model.heads.parameters()))
    bal = gb.get_balancer(balancer)

    def balanced() -> None:
        buf.backward(_losses(forward(x), y))
        buf.apply_(bal)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return balanced


def _explain(base: MultiTaskModel, x: Tensor) -> str:
    torch._dynamo.reset()
    found = torch._dynamo.explain(copy.deepcopy(base))(x)
    return f"{found.graph_count} graph(s), {found.graph_break_count} graph break(s)"


CLOCKS = {"process": time.process_time, "wall": time.perf_counter}
_clock = time.process_time


def _time(fn: Step, reps: int) -> float:
    t0 = _clock()
    for _ in range(reps):
        fn()
    return (_clock() - t0) / reps


def run_trunk(trunk: str, args: argparse.Namespace
              ) -> tuple[dict[str, dict[str, float]], str]:
    """The timings of every variant on one trunk, and the forward's graph count."""
    build, width, shape = (QUICK_TRUNKS if args.quick else TRUNKS)[trunk]
    torch.manual_seed(0)
    base = MultiTaskModel(build(), make_heads(width, args.k))
    x, y = torch.randn(*shape), torch.randn(shape[0], args.k)
    graphs = _explain(base, x)
    torch._dynamo.reset()
    steps, first = {}, {}
    for name in VARIANTS:
        steps[name] = _variant(name, base, x, y, args.backend, args.balancer)
        t0 = time.perf_counter()  # wall time: inductor compiles in worker processes too
        steps[name]()  # compiles, for the compiled variants
        first[name] = time.perf_counter() - t0
        _time(steps[name], args.warmup)
    ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
    millis: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for r in range(args.rounds):
        order = VARIANTS[r % len(VARIANTS):] + VARIANTS[: r % len(VARIANTS)]
        times = {name: _time(steps[name], args.reps) for name in order}
        for name in VARIANTS:
            ratios[name].append(times[name] / times["plain"])
            millis[name].append(1000 * times[name])
    return {name: {"ratio": statistics.median(ratios[name]), **_quartiles(ratios[name]),
                   "ms": statistics.median(millis[name]), "first_s": first[name]}
            for name in VARIANTS}, graphs


def _quartiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"q1": values[0], "q3": values[0]}
    q1, _, q3 = statistics.quantiles(values, n=4)
    return {"q1": q1, "q3": q3}


def table(trunk: str, result: dict[str, dict[str, float]], graphs: str) -> str:
    plain, balanced = result["plain"]["ms"], result["balanced"]["ratio"]
    lines = [f"### {trunk} (plain step {plain:.2f} ms; forward: {graphs})", "",
             "| variant | ms / step | / plain step [IQR] | / same variant eager | first step, s |",
             "|---|---|---|---|---|"]
    for name in VARIANTS:
        r = result[name]
        eager = 1.0 if name.startswith("plain") else balanced
        lines.append(f"| {name} | {r['ms']:.2f} | {r['ratio']:.2f} [{r['q1']:.2f}, "
                     f"{r['q3']:.2f}] | {r['ratio'] / eager:.2f} | {r['first_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 2 rounds")
    parser.add_argument("--trunks", default="mlp,transformer-narrow")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--balancer", default="upgrad")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3, help="steps per timing sample")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--name", default="compile_step")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="process",
                        help="process: CPU time of this process (robust on a shared machine "
                             "with one thread); wall: elapsed time")
    args = parser.parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]
    torch.set_num_threads(args.threads)
    torch._functorch.config.donated_buffer = False  # the K + 1 passes retain the graph
    if args.quick:
        args.rounds, args.reps, args.warmup = min(args.rounds, 2), 1, 1
    parts = [f"torch {torch.__version__}, CPU, {args.threads} thread(s), backend "
             f"{args.backend!r}, K = {args.k}, {args.balancer}, matrix mode; {args.rounds} "
             f"rounds x {args.reps} steps, {args.clock} time, medians (ratios: median of "
             f"per-round ratios)"]
    for trunk in [t for t in args.trunks.split(",") if t]:
        t0 = time.perf_counter()
        parts.append(table(trunk, *run_trunk(trunk, args)))
        print(f"{trunk}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    text = "\n\n".join(parts) + "\n"
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}{'-quick' if args.quick else ''}.txt").write_text(text)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
