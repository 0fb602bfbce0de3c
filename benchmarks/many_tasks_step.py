"""The whole training step at many tasks: K = 64 and 256 on the benchmark trunks.

A thin driver of ``step_overhead.py`` (same variants, same method): the plain step, then
UPGrad and PCGrad in ``matrix`` mode (the ``[K, P]`` buffer of task gradients) and in
``gramian`` mode (``O(K²)`` plus one layer's rows), interleaved in one process, one thread,
the figure the median over rounds of each variant's time over the plain step's in the same
round. Peak memory: each variant in a fresh subprocess, the rise of the peak resident set
size (``VmHWM``) over two steps from just after the model and the batch are built (CUDA: the
allocator's peak), for the plain step and UPGrad in both modes, with the passes the device
prefers (the loop on CPU) and as one batched call (``-batched``: ``gramian`` mode then forms
each layer's block inside the backward).

    python benchmarks/many_tasks_step.py                  # mlp and cnn, K = 64 and 256
    python benchmarks/many_tasks_step.py --trunks mlp --ks 64 --rounds 2   # a quicker run

Writes ``results/many_tasks_step_<device>.md`` and ``.json``; see docs/performance.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the sibling script below

import step_overhead

VARIANTS = "matrix-upgrad,gramian-upgrad,matrix-pcgrad,gramian-pcgrad"
MEMORY_VARIANTS = ("plain", "matrix-upgrad", "gramian-upgrad", "matrix-upgrad-batched",
                   "gramian-upgrad-batched")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trunks", default="mlp,cnn")
    parser.add_argument("--ks", default="64,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-ks", default=None, help="default: the --ks")
    args = parser.parse_args()
    step_overhead.MEMORY_VARIANTS = MEMORY_VARIANTS
    return step_overhead.main([
        "--trunks", args.trunks, "--ks", args.ks, "--rounds", str(args.rounds),
        "--variants", VARIANTS, "--amortise-ks", "",
        "--memory-ks", args.ks if args.memory_ks is None else args.memory_ks,
        "--threads", "1", "--name", "many_tasks_step",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
