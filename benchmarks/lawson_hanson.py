"""The Lawson–Hanson solves behind PCD on rank-deficient rows and MGDA on an ill-conditioned
per-sample Gramian, timed in one process (one thread).

Cases (each the median of ``--rounds`` calls, interleaved):

* ``pcd rank8 K``: ``PCD().combine`` on ``benchmarks/many_tasks.py``'s rank-8 rows
  (``[K, 20000]`` float32, near-duplicate pairs, norms 1e-6 … 1e6), beside the Gramian
  (``compute_gramian``) of the same rows; the singular Gramian sends PCD to its
  least-distance program (one NNLS of ``K − 1`` variables).
* ``mgda per-sample``: the ``[256, 256]`` per-sample Gramian that MGDA receives in the
  transformer's step of ``benchmarks/per_sample.py`` at B = 256 (eigenvalues 5e-12 … 22),
  through ``mgda_weights`` and through the least-squares route alone
  (``_boxqp._solve_factored``: ``psd_factor`` and Lawson–Hanson on the simplex).

The Gramian is recorded once (``per_sample_gramian.py``: the model's step, seeds fixed) and
kept in ``--gramian``.
Run it against two checkouts in alternate processes to compare them::

    PYTHONPATH=src python benchmarks/lawson_hanson.py --ks 256,1024
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from gradbalance.balancers import PCD, _boxqp  # noqa: E402
from gradbalance.balancers._mgda import mgda_weights  # noqa: E402
from gradbalance.balancers._solvers import trace_normalized  # noqa: E402
from gradbalance.gramian import compute_gramian  # noqa: E402
from many_tasks import rank_deficient_rows  # noqa: E402


def cached_gramian(path: Path) -> torch.Tensor:
    """The transformer's ``[256, 256]`` per-sample Gramian (``per_sample_gramian.py``), kept
    in ``path`` after the first run."""
    if path.exists():
        gram: torch.Tensor = torch.load(path)
        return gram
    from per_sample_gramian import per_sample_gramian

    gram = per_sample_gramian("transformer", 256)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(gram, path)
    return gram


def factored_simplex(gram: torch.Tensor) -> Callable[[], object]:
    """MGDA's simplex QP through the least-squares route alone."""
    unit, _ = trace_normalized(gram)
    zeros = torch.zeros(1, unit.shape[0], dtype=torch.float64)

    def call() -> object:
        done = torch.zeros(1, dtype=torch.bool)
        return _boxqp._solve_factored(unit, zeros, zeros, True, None, zeros.clone(), done,
                                      1e-12)
    return call


def cases(ks: list[int], gram_path: Path) -> dict[str, Callable[[], object]]:
    out: dict[str, Callable[[], object]] = {}
    for k in ks:
        rows = rank_deficient_rows(k, 20000, 0)
        out[f"gramian rank8 K={k}"] = lambda rows=rows: compute_gramian(rows)
        out[f"pcd rank8 K={k}"] = lambda rows=rows: PCD().combine(rows)
    gram = cached_gramian(gram_path)
    out["mgda per-sample B=256"] = lambda: mgda_weights(gram)
    out["mgda per-sample B=256, least squares"] = factored_simplex(gram)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--ks", default="256,1024")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gramian", default=str(HERE / "results" / "per_sample_gramian_b256.pt"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    calls = cases([int(k) for k in args.ks.split(",")], Path(args.gramian))
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append((time.perf_counter() - start) * 1e3)
    for name, t in times.items():
        print(f"{name:40s} {statistics.median(t):10.1f} ms   ({', '.join(f'{v:.0f}' for v in t)})")
    print("load average:", ", ".join(f"{v:.1f}" for v in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
