"""The whole training step at many tasks: K = 64 and 256 on the benchmark trunks.

A thin driver of ``step_overhead.py`` (same variants, same method): the plain step, then
UPGrad and PCGrad in ``matrix`` mode (the ``[K, P]`` buffer of task gradients) and in
``gramian`` mode (``O(K²)`` plus one layer's rows), interleaved in one process, one thread,
the figure the median over rounds of each variant's time over the plain step's in the same
round. Peak memory: each variant in a fresh subprocess, the rise of the peak resident set
size (``VmHWM``) over two steps from just after the model and the batch are built (CUDA: the
allocator's peak), for the plain step and UPGrad in both modes with the default passes, and
``gramian`` mode's other two ways: the loop (``-loop``) and one batched call keeping every
layer's operands (``-kept``). From K = 32 on, ``gramian`` mode's default contracts the passes
where that holds less (each layer's block formed inside one batched call from the trunk's
outputs, docs/performance.md, "Modes").

    python benchmarks/many_tasks_step.py                  # mlp and cnn, K = 64 and 256
    python benchmarks/many_tasks_step.py --trunks mlp --ks 64 --rounds 2   # a quicker run
    python benchmarks/many_tasks_step.py --variants gramian-upgrad   # gramian's three ways

Writes ``results/many_tasks_step_<device>.md`` and ``.json``; see docs/performance.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the sibling script below

import gradbalance as gb
import step_overhead

VARIANTS = "matrix-upgrad,gramian-upgrad,matrix-pcgrad,gramian-pcgrad"
#: ``gramian`` mode's three ways of running the K passes: the default (``passes="auto"``:
#: contracted from K = 32 on where that holds less, else the device's choice), the loop, and
#: one batched call that keeps the operands (``auto``'s batched choice below K = 32 on a GPU)
GRAMIAN_PASSES = ("gramian-upgrad-loop", "gramian-upgrad-kept")
MEMORY_VARIANTS = ("plain", "matrix-upgrad", "gramian-upgrad", *GRAMIAN_PASSES)
#: Above this K the kept batched call is not run (its K² head gradients: minutes a step on CPU)
KEPT_MAX_TASKS = 64

_variants = step_overhead.variants


def variants(b: step_overhead.Bench, k: int, amortise_ks: set[int],
             own: Callable[[], step_overhead.Bench], only: list[str] | None = None
             ) -> dict[str, step_overhead.Step]:
    """``step_overhead``'s variants and :data:`GRAMIAN_PASSES` (on request)."""
    table = _variants(b, k, amortise_ks, own, only)
    for name in GRAMIAN_PASSES:
        if only is None or name in table or (name.endswith("kept") and k > KEPT_MAX_TASKS):
            continue
        if name in only if len(only) == 1 else any(o in name for o in only):  # one: memory
            step = step_overhead.v_mode(own(), "gramian", "upgrad",
                                        passes="loop" if name.endswith("loop") else "batched")
            assert step is not None
            if name.endswith("kept"):  # the closure's buffer: its operands kept
                buf = next(c.cell_contents for c in step.__closure__ or ()
                           if isinstance(c.cell_contents, gb.TaskGradBuffer))
                buf._engine.recorder.contract = False  # type: ignore[attr-defined]
            table[name] = step
    return table


def main() -> int:
    step_overhead.variants = variants
    step_overhead.__file__ = __file__  # each memory run in a fresh process of this script
    if "--_memory" in sys.argv:
        step_overhead.MEMORY_VARIANTS = MEMORY_VARIANTS
        return step_overhead.main(sys.argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trunks", default="mlp,cnn")
    parser.add_argument("--ks", default="64,256")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-ks", default=None, help="default: the --ks")
    parser.add_argument("--variants", default=VARIANTS)
    args = parser.parse_args()
    step_overhead.MEMORY_VARIANTS = MEMORY_VARIANTS
    return step_overhead.main([
        "--trunks", args.trunks, "--ks", args.ks, "--rounds", str(args.rounds),
        "--variants", args.variants, "--amortise-ks", "",
        "--memory-ks", args.ks if args.memory_ks is None else args.memory_ks,
        "--threads", "1", "--name", "many_tasks_step",
    ])


if __name__ == "__main__":
    raise SystemExit(main())
