"""Where ``gramian`` mode stops paying: its step time against ``matrix`` mode's over batch size.

On one trunk and K (default: the large MLP 4×2048 at K = 8, UPGrad), the step of each mode is
timed for every batch size, interleaved with the plain step in one process (the method of
``step_overhead.py``: 1 thread, warm-up, median of per-round ratios). ``gramian`` wins while
the layers' rows N = batch are few next to their width (the activation route of
``nn.Linear``); once N grows its layers take the rows route, ``matrix`` mode's work
(docs/performance.md, the per-layer choice). ``auto`` mode, which picks one of the two per batch
shape, runs beside them (after the warm-up steps, in which its trials run).

    python benchmarks/gramian_crossover.py                       # ≈ 5 min
    python benchmarks/gramian_crossover.py --batches 8,64,512 --k 16
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from step_overhead import time_case

os.environ.setdefault("OMP_NUM_THREADS", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny models: a smoke run")
    parser.add_argument("--trunk", default="large")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--balancer", default="upgrad")
    parser.add_argument("--batches", default="4,16,64,256,512,1024")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=5,
                        help="untimed steps per variant (auto's trials run in them)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    timing = argparse.Namespace(quick=args.quick, amortise_ks=[], reps=1, warmup=1,
                                rounds=args.rounds,
                                variants=[f"matrix-{args.balancer}", f"gramian-{args.balancer}",
                                          f"auto-{args.balancer}"])
    timing.warmup = args.warmup
    rows = []
    for batch in [int(b) for b in args.batches.split(",") if b]:
        timing.batch = batch
        result = time_case(args.trunk, args.k, timing, device)
        matrix, gramian = result[f"matrix-{args.balancer}"], result[f"gramian-{args.balancer}"]
        auto, best = result[f"auto-{args.balancer}"], result[f"auto/best-{args.balancer}"]
        rows.append(f"| {batch} | {result['plain_ms']:.1f} | {result['LB']:.2f} | "
                    f"{matrix:.2f} | {gramian:.2f} | {gramian / matrix:.2f} | {auto:.2f} | "
                    f"{best:.2f} |")
        print(rows[-1], file=sys.stderr)
    text = (f"## gramian against matrix mode over batch size ({device.type})\n\n"
            f"trunk {args.trunk}, K = {args.k}, {args.balancer}; torch {torch.__version__}, "
            f"{args.threads} thread(s), {args.rounds} rounds, median of per-round ratios to "
            f"the plain step ({args.warmup} warm-up steps per variant); auto / best: the "
            f"median of auto over the faster of matrix and gramian in the same round\n\n"
            "| batch | plain step (ms) | LB | matrix | gramian | gramian / matrix | auto | "
            "auto / best |\n"
            "|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n")
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{device.type}{'-quick' if args.quick else ''}"
    (out / f"gramian_crossover_{tag}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
