"""The balancers whose singular Gramians go to Lawson–Hanson (MGDA, CR-MOGM, PCD) on every
kind of rows of ``many_tasks.py``, in CPU time (one thread).

Per kind, ``--rounds`` interleaved rounds (after a warm-up) of ``compute_gramian`` and each
balancer's ``combine`` on the same ``[K, 20000]`` float32 rows; the median of each, and
``combine`` as a multiple of the Gramian. CPU time (``time.process_time``) rather than wall
time: on a shared machine it counts this process's work only. Run it against two checkouts in
alternate processes to compare them::

    PYTHONPATH=src python benchmarks/least_squares_kinds.py --ks 256
    PYTHONPATH=src python benchmarks/least_squares_kinds.py --ks 1024 --kinds rank1,span8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from gradbalance.balancers import CRMOGM, MGDA, PCD, Balancer
from gradbalance.gramian import compute_gramian
from many_tasks import KINDS

MAKERS = {"mgda": MGDA, "crmogm": CRMOGM, "pcd": PCD}


def cpu_seconds(call: Callable[[], object]) -> float:
    """CPU seconds of one call."""
    start = time.process_time()
    call()
    return time.process_time() - start


def one_kind(kind: str, k: int, names: list[str], rounds: int) -> str:
    """A line: the Gramian's median in ms, each balancer's median in ms and as a multiple."""
    rows = KINDS[kind](k, 20_000, seed=k)
    times: dict[str, list[float]] = {"gramian": [], **{n: [] for n in names}}
    for r in range(rounds + 1):
        spent = {"gramian": cpu_seconds(lambda: compute_gramian(rows))}
        for name in names:
            bal: Balancer = MAKERS[name]()
            spent[name] = cpu_seconds(lambda bal=bal: bal.combine(rows))
        if r:
            for name, t in spent.items():
                times[name].append(t)
    gram = statistics.median(times["gramian"])
    medians = [statistics.median(times[n]) for n in names]
    cells = [f"{t * 1e3:.0f} ms ({t / gram:.2f}×)" for t in medians]
    return f"| {kind} | {gram * 1e3:.0f} ms | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="256")
    parser.add_argument("--kinds", default="all")
    parser.add_argument("--only", default="mgda,crmogm,pcd")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = list(KINDS) if args.kinds == "all" else args.kinds.split(",")
    names = args.only.split(",")
    for k in (int(v) for v in args.ks.split(",")):
        print(f"K = {k}\n\n| kind | gramian | " + " | ".join(names) + " |")
        print("|---" * (len(names) + 2) + "|")
        for kind in kinds:
            print(one_kind(kind, k, names, args.rounds), flush=True)


if __name__ == "__main__":
    main()
