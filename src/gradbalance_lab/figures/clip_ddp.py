"""Clip tutorial, Relatives and variants: under data parallelism, clip after the sync.

Setting (float64): a 3-task model (MLP trunk 8→16→16, linear heads, seeded identically on
every rank), one batch of 32 split into two shards of 16, two CPU processes of one thread
each (forked on Linux, fresh interpreters elsewhere; killed past a 120 s deadline) joined by a
``gloo`` process group, and the limit τ = 1 (below the batch's gradient norm, so every clip acts).

* after the sync (the library's way): :class:`~gradbalance.TaskGradBuffer` all-reduces the
  task gradients in ``apply_`` (``Sum`` balancer; also ``clip=TaskClip(0.5)``, the per-task
  clip, which therefore sees the reduced rows), then each rank calls
  ``clip_grad_norm_(τ)`` on the averaged ``.grad``;
* before the sync: the same step with ``process_group="local"``, ``clip_grad_norm_(τ)`` on
  each rank's own gradient, then :func:`gradbalance.distributed.all_reduce_grads_`.

Both are compared with one process running the whole batch of 32 (computed here, outside the
process group). Float64: equal means equal to about 1e-16 relative.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from gradbalance.balancers import get_balancer
from gradbalance.clip import TaskClip
from gradbalance.step import TaskGradBuffer
from gradbalance_lab.figures._common import Claim, angle_deg, pyplot, save_figure
from gradbalance_lab.models import MultiTaskModel, make_heads, mlp_trunk, regression_losses

NAME = "clip_ddp"
TITLE = "Clip tutorial, Relatives and variants: clip after the data-parallel sync (2 gloo ranks)"
TAU = 1.0
TASK_TAU = 0.5
WORLD = 2
BATCH = 32
DEADLINE_S = 120.0


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``, which the step has set."""
    assert p.grad is not None
    return p.grad


def setup() -> tuple[MultiTaskModel, torch.Tensor, torch.Tensor]:
    """The model and the whole batch, identical on every rank."""
    torch.manual_seed(0)
    model = MultiTaskModel(mlp_trunk(8, 16, 2), make_heads(16, 3)).double()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH, 8, generator=gen, dtype=torch.float64)
    y = torch.randn(BATCH, 3, generator=gen, dtype=torch.float64) * 3
    return model, x, y


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([_grad(p).reshape(-1) for p in model.parameters()]).clone()


def step(x: torch.Tensor, y: torch.Tensor, group: Any, task_clip: bool) -> dict[str, Any]:
    """One step on ``x, y`` with the buffer's ``process_group=group``; the global clip after
    ``apply_``. Returns the pre-clip norm, the clipped gradient and the per-task norms."""
    model, _, _ = setup()
    buf = TaskGradBuffer(model.shared_parameters(), model.head_parameters(),
                         process_group=group)
    buf.backward(regression_losses(model(x), y))
    stats = buf.apply_(get_balancer("sum"), clip=TaskClip(TASK_TAU) if task_clip else None)
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), TAU))
    return {"norm": norm, "update": _flat(model), "model": model,
            "task_norms": None if stats.pre_clip_norms is None
            else stats.pre_clip_norms.tolist()}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from gradbalance.distributed import LOCAL, all_reduce_grads_

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        _, x, y = setup()
        shard = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        after = step(x[shard], y[shard], None, task_clip=False)
        per_task = step(x[shard], y[shard], None, task_clip=True)
        before = step(x[shard], y[shard], LOCAL, task_clip=False)
        all_reduce_grads_(before["model"].parameters())
        result = {"after_norm": after["norm"], "after": after["update"],
                  "task_norms": per_task["task_norms"], "before_norm": before["norm"],
                  "before": _flat(before["model"])}
        dist.barrier()
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _forked(init_file: str, out_dir: str, deadline: float) -> list[int | None]:
    """The ranks as forked processes (they inherit the imports: well under a second)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_worker, args=(rank, init_file, out_dir), daemon=True)
             for rank in range(WORLD)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [proc.exitcode for proc in procs]


def _subprocesses(init_file: str, out_dir: str, deadline: float) -> list[int | None]:
    """The ranks as fresh interpreters (where fork is not the platform's way)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(
        [sys.executable, "-c", f"from {__name__} import _worker; "
                               f"_worker({rank}, {init_file!r}, {out_dir!r})"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        for rank in range(WORLD)]
    try:
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [proc.returncode for proc in procs]


def run_ranks() -> list[dict[str, Any]]:
    """Run the two gloo ranks; their results, or RuntimeError (a rank failed, or the
    deadline passed: every rank still running is killed)."""
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        deadline = time.monotonic() + DEADLINE_S
        launch = _forked if sys.platform == "linux" else _subprocesses
        codes = launch(init_file, tmp, deadline)
        files = [os.path.join(tmp, f"rank{r}.pt") for r in range(WORLD)]
        # gloo's teardown can abort a rank after it wrote its results: judge by the results
        if not all(os.path.exists(f) for f in files):
            late = time.monotonic() >= deadline
            raise RuntimeError(
                f"the {WORLD} gloo ranks did not finish within {DEADLINE_S:.0f} s" if late
                else f"a gloo rank failed (exit codes {codes})")
        return [torch.load(f, weights_only=False) for f in files]


def compute(quick: bool = False) -> dict[str, Any]:
    _, x, y = setup()  # the reference first: forked ranks inherit what it imported
    full = step(x, y, "local", task_clip=False)
    full_tasks = step(x, y, "local", task_clip=True)["task_norms"]
    start = time.perf_counter()
    ranks = run_ranks()
    seconds = time.perf_counter() - start
    ref = full["update"]
    out: dict[str, Any] = {"seconds": seconds, "full_norm": full["norm"],
                           "full_task_norms": full_tasks}
    out["after_norms"] = [r["after_norm"] for r in ranks]
    out["before_norms"] = [r["before_norm"] for r in ranks]
    out["task_norms"] = [r["task_norms"] for r in ranks]
    out["after_gap"] = max(float((r["after"] - ref).norm() / ref.norm()) for r in ranks)
    out["ranks_same"] = all(torch.equal(r["after"], ranks[0]["after"]) for r in ranks)
    before = ranks[0]["before"]
    out["before_ranks_same"] = all(torch.equal(r["before"], before) for r in ranks)
    out["before_gap"] = float((before - ref).norm() / ref.norm())
    out["before_angle"] = angle_deg(before, ref)
    out["before_len"], out["after_len"] = float(before.norm()), float(ref.norm())
    return out


def claims(result: dict[str, Any]) -> list[Claim]:
    full = result["full_norm"]
    after = result["after_norms"]
    norm_gap = max(abs(n - full) / full for n in after)
    task_gap = max(abs(a - b) / b for row in result["task_norms"]
                   for a, b in zip(row, result["full_task_norms"]))
    before = result["before_norms"]
    return [
        Claim("§Relatives and variants: under distributed training, clip after gradient "
              "synchronisation, so all replicas clip the same global norm",
              "2 gloo ranks × 16 samples: pre-clip norm "
              + ", ".join(f"{n:.10g}" for n in after) + f" vs one process on all 32: "
              f"{full:.10g} (gap {norm_gap:.1e}); clipped update vs one process "
              f"{result['after_gap']:.1e}; ranks bitwise equal: {result['ranks_same']} "
              f"(the two ranks took {result['seconds']:.1f} s)",
              norm_gap < 1e-12 and result["after_gap"] < 1e-12 and result["ranks_same"]),
        Claim("§Relatives and variants: ... clipping before the sync gives a different update",
              "local pre-clip norms " + ", ".join(f"{n:.4g}" for n in before)
              + f" (full batch {full:.4g}); averaged update turned "
              f"{result['before_angle']:.2f}° from the full-batch clipped one, length "
              f"{result['before_len']:.4g} vs {result['after_len']:.4g} (τ = {TAU:g}); "
              f"difference {result['before_gap']:.2g} (relative) against rounding "
              f"{max(result['after_gap'], 1e-16):.1e}",
              result["before_gap"] > 1e6 * max(result["after_gap"], 1e-16)
              and result["before_ranks_same"]),
        Claim("§Relatives and variants: the library's per-task clip (apply_(clip=TaskClip)) "
              "runs after the all-reduce",
              "per-task pre-clip norms on the ranks "
              + "; ".join(", ".join(f"{v:.6g}" for v in row) for row in result["task_norms"])
              + " vs one process " + ", ".join(f"{v:.6g}" for v in result["full_task_norms"])
              + f" (gap {task_gap:.1e})",
              task_gap < 1e-12),
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    labels = ["rank 0", "rank 1"]
    pos = [0, 1]
    ax.bar([p - 0.2 for p in pos], result["before_norms"], width=0.4, color="C3",
           label="clip before the sync: each rank's own norm")
    ax.bar([p + 0.2 for p in pos], result["after_norms"], width=0.4, color="C0",
           label="clip after the sync (TaskGradBuffer all-reduce)")
    ax.axhline(result["full_norm"], color="k", ls=":",
               label=f"one process, whole batch: {result['full_norm']:.4g}")
    ax.axhline(TAU, color="grey", ls="--", lw=0.8, label=f"τ = {TAU:g}")
    ax.set_xticks(pos, labels)
    ax.set_xlabel("data-parallel rank (16 of the 32 samples each)")
    ax.set_ylabel("pre-clip gradient norm seen by the clip")
    ax.set_ylim(0, max(result["before_norms"] + [result["full_norm"]]) * 1.6)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"update turned {result['before_angle']:.1f}° when clipped before the sync",
                 fontsize=10)
    fig.suptitle(TITLE, fontsize=9)
    save_figure(fig, path)
