"""The cost of global gradient clipping against the backward pass, by parameter count.

The clipping text states that clipping by the global norm costs "one pass to compute the
norm, one to scale — O(P) in parameter count, negligible against the backward pass". Per
trunk (MLPs of P ≈ 4·10³ … 8·10⁶ parameters, batch 64, and the benchmark transformer), this
times, interleaved in one process on one thread: the forward and backward of a summed
regression loss, ``torch.nn.utils.clip_grad_norm_`` on the gradients it left (a limit every
step clips), and the library's parameter clippers ``AutoClip`` (the norm and a percentile of
its history) and ``AGC`` (unit-wise norms of the weights and the gradients). It prints the
median of each, each clipper as a fraction of the forward and backward, and the clip's
nanoseconds per parameter (constant in P: linear cost).

    python benchmarks/clip_cost.py --quick    # smoke run, a few seconds
    python benchmarks/clip_cost.py            # writes results/clip_cost_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

import gradbalance as gb
from gradbalance_lab.models import mlp_trunk, transformer_trunk

#: ``(trunk, input)`` makers by name: MLP widths spanning P ≈ 4·10³ … 8·10⁶, the transformer.
Trunk = Callable[[], tuple[nn.Module, Tensor]]


def _mlp(width: int, depth: int = 3) -> Trunk:
    def make() -> tuple[nn.Module, Tensor]:
        return mlp_trunk(64, width, depth), torch.randn(64, 64)
    return make


def _transformer() -> tuple[nn.Module, Tensor]:
    return transformer_trunk(), torch.randn(16, 32, 128)


TRUNKS: dict[str, Trunk] = {"mlp-32": _mlp(32), "mlp-128": _mlp(128), "mlp-512": _mlp(512),
                            "mlp-2048": _mlp(2048), "transformer": _transformer}


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(trunk: nn.Module, x: Tensor, rounds: int) -> dict[str, float]:
    """Median seconds of the forward and backward and of each clipper, interleaved."""
    params = [p for p in trunk.parameters() if p.requires_grad]

    def backward() -> None:
        for p in params:
            p.grad = None
        trunk(x).square().mean().backward()

    def norm_of_grads() -> float:
        return float(torch.nn.utils.get_total_norm([p.grad for p in params]))  # type: ignore[misc]

    auto, agc = gb.AutoClip(percentile=10.0), gb.AGC(0.001)
    backward()
    limit = 0.1 * norm_of_grads()  # every step clips: the scaling pass runs
    clippers: dict[str, Callable[[], object]] = {
        "clip_grad_norm_": lambda: torch.nn.utils.clip_grad_norm_(params, limit),
        "AutoClip": lambda: auto(params),
        "AGC": lambda: agc(params),
    }
    samples: dict[str, list[float]] = {"backward": [], **{name: [] for name in clippers}}
    for _ in range(rounds + 1):  # the first round warms up
        for name, clip in clippers.items():
            backward()  # fresh gradients for each clipper, so each scales unclipped ones
            samples["backward"].append(_timed(backward))
            samples[name].append(_timed(clip))
    return {name: statistics.median(times[len(times) // (rounds + 1):])
            for name, times in samples.items()}


def table(rows: dict[str, tuple[int, dict[str, float]]]) -> str:
    lines = ["| trunk | P | forward + backward (ms) | clip_grad_norm_ (ms) | / backward | "
             "ns per parameter | AutoClip / backward | AGC / backward |",
             "|---|---|---|---|---|---|---|---|"]
    for name, (p, t) in rows.items():
        b, c = t["backward"], t["clip_grad_norm_"]
        lines.append(f"| {name} | {p:,} | {b * 1e3:.2f} | {c * 1e3:.3f} | {c / b:.3f} | "
                     f"{c / p * 1e9:.2f} | {t['AutoClip'] / b:.3f} | {t['AGC'] / b:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two small trunks, 3 rounds")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = ["mlp-32", "mlp-128"] if args.quick else list(TRUNKS)
    rounds = 3 if args.quick else args.rounds
    rows = {}
    for name in names:
        torch.manual_seed(0)
        trunk, x = TRUNKS[name]()
        p = sum(q.numel() for q in trunk.parameters() if q.requires_grad)
        rows[name] = (p, measure(trunk, x, rounds))
        print(f"{name}: P = {p:,} done", flush=True)
    text = table(rows)
    print(text)
    if not args.quick:
        out = Path(args.out) / "clip_cost_cpu.md"
        out.write_text(
            f"# Global clipping against the backward pass ({datetime.date.today()})\n\n"
            f"`python benchmarks/clip_cost.py` (torch {torch.__version__}, {args.threads} "
            f"thread(s), median of {rounds} interleaved rounds): each clipper on the "
            f"gradients of one forward and backward of a summed loss, a limit every step "
            f"clips.\n\n{text}\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
