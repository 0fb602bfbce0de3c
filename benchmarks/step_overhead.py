"""Cost of one balanced training step, side by side, in units of the plain step.

The plain step is ``sum(losses).backward()`` + ``optimizer.step()`` + ``zero_grad``. For each
trunk and K, every variant runs in the same process, interleaved (the order rotates every
round: A B C, B C A, ...), after a warm-up; the reported figure is the median over rounds of
``t_variant / t_plain`` measured in the same round (``auto/best-<balancer>``: ``auto`` mode
over the faster of ``matrix`` and ``gramian`` in the same round; ``gramian`` is the mode as
shipped, each layer on the route its per-layer cost model picks). The floor LB(K) = F + K·B
is measured in the same run: F = forward alone, B = plain step − F (one backward + the
optimizer step).

Peak memory: each variant runs in a fresh subprocess (``--memory-ks``); on CPU the figure is the
rise of the peak resident set size (``VmHWM``; ``ru_maxrss`` where /proc is missing) over two
steps, from just after the model and the batch are built (so it counts activations,
gradients, buffers and optimizer state, not the Python/torch baseline); on CUDA it is
``torch.cuda.max_memory_allocated()`` minus the allocation before the steps. CUDA timings
use CUDA events.

    python benchmarks/step_overhead.py --quick            # smoke run, a few seconds
    python benchmarks/step_overhead.py                    # full run (see benchmarks/README.md)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import gradbalance as gb
from gradbalance_lab.models import (
    MultiTaskModel,
    cnn_trunk,
    make_heads,
    mlp_trunk,
    transformer_trunk,
)

Step = Callable[[], None]

TRUNKS = {
    # name: (trunk builder, feature width, input shape)
    "mlp": (lambda: mlp_trunk(256, 512, 3), 512, (256, 256)),
    "cnn": (lambda: cnn_trunk(32), 64, (128, 1, 28, 28)),
    # PyTorch's nn.TransformerEncoderLayer as it comes (feed-forward 2048, dropout 0.1)
    "transformer": (lambda: transformer_trunk(128, 2, 4, 0.1, 2048), 128, (32, 64, 128)),
    # the same encoder with a narrow feed-forward (2 * d_model) and no dropout
    "transformer-narrow": (lambda: transformer_trunk(128, 2, 4), 128, (32, 64, 128)),
    "large": (lambda: mlp_trunk(2048, 2048, 4), 2048, (16, 2048)),
}
QUICK_TRUNKS = {
    "mlp": (lambda: mlp_trunk(32, 64, 3), 64, (16, 32)),
    "cnn": (lambda: cnn_trunk(4), 8, (8, 1, 28, 28)),
    "transformer": (lambda: transformer_trunk(16, 2, 2, 0.1, 64), 16, (4, 8, 16)),
    "transformer-narrow": (lambda: transformer_trunk(16, 2, 2), 16, (4, 8, 16)),
    "large": (lambda: mlp_trunk(256, 256, 4), 256, (4, 256)),
}
BALANCERS = ("pcgrad", "mgda", "upgrad")
TORCHJD = ("upgrad", "mgda")


class Bench:
    """One trunk with K heads, a batch, targets and an SGD optimizer."""

    def __init__(self, trunk: str, k: int, device: torch.device, quick: bool,
                 batch: int | None = None) -> None:
        build, width, shape = (QUICK_TRUNKS if quick else TRUNKS)[trunk]
        if batch is not None:
            shape = (batch, *shape[1:])
        torch.manual_seed(0)
        self.model = MultiTaskModel(build(), make_heads(width, k)).to(device)
        self.x = torch.randn(*shape, device=device)
        self.y = torch.randn(shape[0], k, device=device)
        self.k = k
        self.shared = self.model.shared_parameters()
        self.heads = self.model.head_parameters()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)

    def features(self) -> Tensor:
        return self.model.trunk(self.x)

    def loss_list(self, feats: Tensor) -> list[Tensor]:
        """K MSE batch means, one scalar per task."""
        return [
            nn.functional.mse_loss(head(feats).squeeze(-1), self.y[:, k])
            for k, head in enumerate(self.model.heads)
        ]

    def losses(self, feats: Tensor) -> Tensor:
        return torch.stack(self.loss_list(feats))



    def finish(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def squared_errors(outputs: list[Tensor], y: Tensor) -> Tensor:
    """Per-sample losses ``[B, K]`` (``reduction='none'``) of the K heads' outputs."""
    return torch.stack([(o.squeeze(-1) - y[:, k]) ** 2 for k, o in enumerate(outputs)], dim=1)


def _balancer(name: str) -> gb.Balancer | None:
    cls = gb.BALANCERS.get(name)
    return None if cls is None else cls()


def _write_grads(params: list[Tensor], vector: Tensor) -> None:
    start = 0
    for p in params:
        n = p.numel()
        part = vector[start : start + n].view_as(p)
        if p.grad is None:
            p.grad = part.clone()
        else:
            p.grad.add_(part)
        start += n


def _hand_combine(balancer: gb.Balancer, matrix: Tensor, losses: Tensor) -> Tensor:
    if balancer.from_gramian:
        gram = gb.functional.compute_gramian(matrix)
        return balancer.compute_weights(gram, losses).to(matrix.dtype) @ matrix
    return balancer(matrix, losses)


# -- variants: each returns a step function, or None when unavailable ------------------------

def v_forward(b: Bench) -> Step:
    def step() -> None:
        b.losses(b.features())
    return step


def v_plain(b: Bench) -> Step:
    def step() -> None:
        b.losses(b.features()).sum().backward()
        b.finish()
    return step


def v_mode(b: Bench, mode: str, name: str, update_every: int = 1,
           passes: str = "auto") -> Step | None:
    balancer = _balancer(name)
    if balancer is None:
        return None
    kwargs: dict[str, Any] = {"modules": b.model.trunk} if mode in ("gramian", "auto") else {}
    buf = gb.TaskGradBuffer(b.shared, b.heads, mode=mode, update_every=update_every,
                            passes=passes, **kwargs)

    def step() -> None:
        feats = b.features()
        buf.backward(b.losses(feats), features=feats if mode == "features" else None)
        buf.apply_(balancer)
        b.finish()
    return step


def v_per_sample(b: Bench, name: str, route: str) -> Step | None:
    """``PerSampleClip`` over trunk and heads, then the matrix step; the per-sample norms by
    ``route``: ``graph`` (any graph), ``model`` (torch.func) or ``ghost`` (nn.Linear only)."""
    balancer = _balancer(name)
    ghost = None
    if route == "ghost":
        try:
            ghost = gb.clip.GhostNorms(b.model)
        except ValueError:  # the trunk has parameters outside nn.Linear layers
            return None
    if balancer is None:
        return None
    buf = gb.TaskGradBuffer(b.shared, b.heads)
    clip = gb.clip.PerSampleClip(max_norm=1.0)
    params = b.shared + b.heads

    def losses() -> Tensor:
        if route == "model":
            return clip.losses_of_model(b.model, squared_errors, b.x, b.y)
        per_sample = squared_errors(b.model(b.x), b.y)
        return clip(per_sample, params, norms=None if ghost is None else ghost.norms(per_sample))

    def step() -> None:
        buf.backward(losses())
        buf.apply_(balancer)
        b.finish()
    return step


def v_handloop(b: Bench, name: str) -> Step | None:
    """K autograd.grad calls into a preallocated [K, P], the same combine, .grad written."""
    balancer = _balancer(name)
    if balancer is None:
        return None
    numel = sum(p.numel() for p in b.shared)
    matrix = torch.empty(b.k, numel, device=b.x.device)

    def step() -> None:
        losses = b.losses(b.features())
        torch.autograd.backward(losses.sum(), inputs=b.heads, retain_graph=True)
        for k in range(b.k):
            grads = torch.autograd.grad(losses[k], b.shared, retain_graph=k < b.k - 1)
            torch.cat([g.reshape(-1) for g in grads], out=matrix[k])
        _write_grads(b.shared, _hand_combine(balancer, matrix, losses.detach()))
        b.finish()
    return step


def v_libmtl(b: Bench, name: str) -> Step | None:
    """LibMTL's loop: K ``loss.backward(retain_graph=True)``, copying and zeroing trunk grads."""
    balancer = _balancer(name)
    if balancer is None:
        return None
    numel = sum(p.numel() for p in b.shared)

    def step() -> None:
        losses = b.losses(b.features())
        matrix = torch.zeros(b.k, numel, device=b.x.device)
        for k in range(b.k):
            losses[k].backward(retain_graph=k < b.k - 1)
            start = 0
            for p in b.shared:
                n = p.numel()
                if p.grad is not None:
                    matrix[k, start : start + n].copy_(p.grad.reshape(-1))
                    p.grad.zero_()
                start += n
        _write_grads(b.shared, _hand_combine(balancer, matrix, losses.detach()))
        b.finish()
    return step


def _torchjd_aggregator(name: str, weighting: bool) -> Any:
    try:
        from torchjd import aggregation

        table = {"upgrad": ("UPGrad", "UPGradWeighting"), "mgda": ("MGDA", "MGDAWeighting")}
        return getattr(aggregation, table[name][1 if weighting else 0])()
    except ImportError as error:  # torchjd, or UPGrad's quadprog, not installed
        print(f"skipping torchjd {name}: {error}", file=sys.stderr)
        return None


def v_torchjd(b: Bench, name: str) -> Step | None:
    aggregator = _torchjd_aggregator(name, weighting=False)
    if aggregator is None:
        return None
    from torchjd.autojac import jac_to_grad, mtl_backward

    def step() -> None:
        feats = b.features()
        mtl_backward(b.loss_list(feats), features=feats, shared_params=b.shared)
        jac_to_grad(b.shared, aggregator)
        b.finish()
    return step


def v_autogram(b: Bench, name: str) -> Step | None:
    weighting = _torchjd_aggregator(name, weighting=True)
    if weighting is None:
        return None
    from torchjd.autogram import Engine

    engine = Engine(*b.model.trunk.children(), batch_dim=None)

    def step() -> None:
        losses = b.losses(b.features())
        gram = engine.compute_gramian(losses)
        losses.backward(weighting(gram))
        b.finish()
    return step


def variants(b: Bench, k: int, amortise_ks: set[int], own: Callable[[], Bench],
             only: list[str] | None = None) -> dict[str, Step]:
    """Every variant; those that hook the trunk's forward get their own copy of the model."""
    table: dict[str, Step | None] = {"plain": v_plain(b), "forward": v_forward(b)}
    for name in BALANCERS:
        for mode in ("matrix", "gramian", "auto", "features"):
            hooked = mode in ("gramian", "auto")
            table[f"{mode}-{name}"] = v_mode(own() if hooked else b, mode, name)
    for name in ("pcgrad", "mgda"):  # the library against the same code written by hand
        table[f"handloop-{name}"] = v_handloop(b, name)
    table["libmtl-upgrad"] = v_libmtl(b, "upgrad")
    for name in TORCHJD:
        table[f"torchjd-{name}"] = v_torchjd(b, name)
        table[f"autogram-{name}"] = v_autogram(own(), name)
    if k in amortise_ks:
        table["matrix-upgrad-T10"] = v_mode(b, "matrix", "upgrad", update_every=10)
    if only is not None and any("passes" in o for o in only):  # on request only
        for passes in ("loop", "batched"):
            table[f"passes-{passes}"] = v_mode(b, "matrix", "mgda", passes=passes)
    if only is not None and any("batched" in o for o in only):  # on request only
        for mode in ("matrix", "gramian"):  # one vmapped call for the K passes
            hooked = mode == "gramian"
            table[f"{mode}-upgrad-batched"] = v_mode(own() if hooked else b, mode, "upgrad",
                                                     passes="batched")
    if only is not None and any("persample" in o for o in only):  # on request only
        for route in ("graph", "model", "ghost"):  # the ghost hooks need their own model
            table[f"persample-{route}-mgda"] = v_per_sample(own() if route == "ghost" else b,
                                                             "mgda", route)
    return {key: fn for key, fn in table.items() if fn is not None and (
        only is None or key in ("plain", "forward") or any(o in key for o in only))}


# -- timing -----------------------------------------------------------------------------------

def _timer(device: torch.device) -> Callable[[Step, int], float]:
    if device.type == "cuda":
        def cuda_time(fn: Step, reps: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000 / reps
        return cuda_time

    def cpu_time(fn: Step, reps: int) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps
    return cpu_time


def time_case(trunk: str, k: int, args: argparse.Namespace, device: torch.device
              ) -> dict[str, float]:
    batch = getattr(args, "batch", None)
    b = Bench(trunk, k, device, args.quick, batch)
    table = variants(b, k, set(args.amortise_ks),
                     lambda: Bench(trunk, k, device, args.quick, batch), args.variants)
    names = list(table)
    timer = _timer(device)
    for name in names:  # warm-up
        timer(table[name], args.warmup)
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        times = {}
        for name in order:
            # T10 must average over a whole period of 10 steps.
            reps = 10 if name.endswith("-T10") else args.reps
            times[name] = timer(table[name], reps)
        for name in names:
            ratios[name].append(times[name] / times["plain"])
        for name in BALANCERS:  # auto against the faster exact mode of the same round
            if all(f"{m}-{name}" in times for m in ("auto", "matrix", "gramian")):
                best = min(times[f"matrix-{name}"], times[f"gramian-{name}"])
                ratios.setdefault(f"auto/best-{name}", []).append(times[f"auto-{name}"] / best)
    result = {name: statistics.median(values) for name, values in ratios.items()}
    result["plain_ms"] = 1000 * statistics.median(
        [timer(table["plain"], args.reps) for _ in range(3)]
    )
    f = result["forward"]
    result["F"], result["B"] = f, 1.0 - f
    result["LB"] = f + k * (1.0 - f)
    return result


# -- memory -----------------------------------------------------------------------------------

def measure_memory(trunk: str, k: int, variant: str, quick: bool, device: torch.device
                   ) -> float:
    """Peak extra memory (MiB) of two steps of ``variant``, measured in this process."""
    b = Bench(trunk, k, device, quick)
    fn = variants(b, k, {k}, lambda: b, only=[variant]).get(variant)
    if fn is None:
        return float("nan")
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    base = _peak_rss_kib()
    fn()
    fn()
    return (_peak_rss_kib() - base) / 1024  # KiB -> MiB


def _peak_rss_kib() -> int:
    """This process's peak resident set size in KiB.

    ``VmHWM`` from ``/proc/self/status`` where it exists: unlike ``ru_maxrss``, which Linux
    carries over ``execve`` from the parent (so a child of a large parent reads no rise), it
    belongs to the process's own address space. Elsewhere ``ru_maxrss``.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


MEMORY_VARIANTS = ("plain", "matrix-upgrad", "gramian-upgrad", "auto-upgrad", "features-upgrad",
                   "handloop-upgrad", "libmtl-upgrad", "torchjd-upgrad", "autogram-upgrad")


def memory_case(trunk: str, k: int, args: argparse.Namespace) -> dict[str, float]:
    out = {}
    for variant in MEMORY_VARIANTS:
        cmd = [sys.executable, __file__, "--_memory", trunk, str(k), variant,
               "--threads", str(args.threads), "--device", args.device]
        if args.quick:
            cmd.append("--quick")
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        try:
            out[variant] = float(proc.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            print(f"memory run failed for {trunk} K={k} {variant}: {proc.stderr[-300:]}",
                  file=sys.stderr)
            out[variant] = float("nan")
    return out


# -- report -----------------------------------------------------------------------------------

def _fmt(value: float) -> str:
    return "—" if value != value else f"{value:.2f}"


def time_table(results: dict[tuple[str, int], dict[str, float]]) -> str:
    keys = sorted({name for r in results.values() for name in r}
                  - {"plain_ms", "F", "B", "LB", "plain", "forward"})
    order = ["LB"] + [k for k in keys if k.startswith("matrix")] + [
        k for k in keys if not k.startswith("matrix")]
    cases = sorted(results, key=lambda c: (list(TRUNKS).index(c[0]), c[1]))
    head = "| variant | " + " | ".join(f"{t} K={k}" for t, k in cases) + " |"
    lines = [head, "|---|" + "---|" * len(cases)]
    lines.append("| plain step (ms) | " + " | ".join(
        f"{results[c]['plain_ms']:.1f}" for c in cases) + " |")
    lines.append("| F (forward) | " + " | ".join(_fmt(results[c]["F"]) for c in cases) + " |")
    for name in order:
        lines.append(f"| {name} | " + " | ".join(
            _fmt(results[c].get(name, float("nan"))) for c in cases) + " |")
    return "\n".join(lines)


def memory_table(results: dict[tuple[str, int], dict[str, float]]) -> str:
    cases = sorted(results, key=lambda c: (list(TRUNKS).index(c[0]), c[1]))
    lines = ["| variant (peak MiB) | " + " | ".join(f"{t} K={k}" for t, k in cases) + " |",
             "|---|" + "---|" * len(cases)]
    for name in MEMORY_VARIANTS:
        lines.append(f"| {name} | " + " | ".join(
            f"{results[c][name]:.0f}" if results[c][name] == results[c][name] else "—"
            for c in cases) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models, 3 rounds: a smoke run")
    parser.add_argument("--trunks", default="mlp,cnn,transformer,transformer-narrow,large")
    parser.add_argument("--ks", default=None, help="default 2,4,8,16 (--quick: 2,4)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reps", type=int, default=1, help="steps per timing sample")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--amortise-ks", default="8", help="K values that time update_every=10")
    parser.add_argument("--memory-ks", default=None,
                        help="K values with peak memory, '' for none (default 8,16; --quick: none)")
    parser.add_argument("--variants", default="",
                        help="comma-separated substrings: time only matching variants")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--batch", type=int, default=None,
                        help="override every trunk's batch size")
    parser.add_argument("--name", default="step_overhead",
                        help="file name stem of the results (<name>_<device>.md/.json)")
    parser.add_argument("--_memory", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args._memory:
        trunk, k, variant = args._memory
        print(measure_memory(trunk, int(k), variant, args.quick, device))
        return 0
    if args.quick:
        args.rounds, args.reps, args.warmup = min(args.rounds, 3), 1, 1
    if args.ks is None:
        args.ks = "2,4" if args.quick else "2,4,8,16"
    if args.memory_ks is None:
        args.memory_ks = "" if args.quick else "8,16"
    args.amortise_ks = [int(k) for k in args.amortise_ks.split(",") if k]
    args.variants = [v for v in args.variants.split(",") if v] or None
    trunks = [t for t in args.trunks.split(",") if t]
    ks = [int(k) for k in args.ks.split(",") if k]
    memory_ks = {int(k) for k in args.memory_ks.split(",") if k}
    timing, memory = {}, {}
    for trunk in trunks:
        for k in ks:
            t0 = time.perf_counter()
            timing[(trunk, k)] = time_case(trunk, k, args, device)
            if k in memory_ks:
                memory[(trunk, k)] = memory_case(trunk, k, args)
            print(f"{trunk} K={k}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    tag = f"{device.type}{'-quick' if args.quick else ''}"
    header = (f"torch {torch.__version__}, device {device}, {args.threads} thread(s), "
              f"{args.rounds} rounds x {args.reps} steps, median of per-round ratios to the "
              f"plain step")
    text = (f"## Step time / plain step ({tag})\n\n{header}\n\n{time_table(timing)}\n")
    if memory:
        how = ("CUDA allocator peak" if device.type == "cuda"
               else "rise of the peak resident set size (VmHWM) over two steps, in a fresh "
               "subprocess per variant")
        text += (f"\n## Peak memory of two steps, MiB ({tag})\n\n{how}\n\n"
                 f"{memory_table(memory)}\n")
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}_{tag}.md").write_text(text)
    raw = {f"{t}:{k}": {"time": timing[(t, k)], "memory": memory.get((t, k), {})}
           for t, k in timing}
    (out / f"{args.name}_{tag}.json").write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
