"""Combine time against the number of tasks: every registered balancer at K = 8 … 1,024.

For each K, one ``[K, P]`` float32 matrix of conflicting rows (each row a random multiple of a
shared direction plus noise, so about half the pairs conflict), then rounds in which the
Gramian (``compute_gramian``, the product every weighted balancer's ``combine`` starts with;
the ratio base) and the plain float32 ``J Jᵀ``, every balancer's
``combine`` and, if installed, TorchJD's aggregators each run once, in an order that rotates
each round (interleaved). The figure is the median over the rounds, in ms and as a multiple
of the Gramian's median. A method whose call at some K takes more than ``--budget / 8``
seconds is not run at the larger K (marked ``cut``; cubic growth would take it past the
budget), and a single call over ``--budget`` ends its rounds at that K. A result that is not
finite is reported as such (``--kind rank8``: rows in a rank-8 span, near-duplicate pairs,
norms spanning 1e-6 … 1e6).

    python benchmarks/many_tasks.py                      # K = 8 … 1,024, P = 20,000
    python benchmarks/many_tasks.py --ks 8,64 --p 2000   # smoke run
    python benchmarks/many_tasks.py --kind rank8 --ks 64,256 --name cpu_rank8
    python benchmarks/many_tasks.py --kinds all --ks 256,1024 --rounds 1 --no-torchjd

``--kinds`` runs several kinds of rows (``all``: every entry of :data:`KINDS`, among them near
duplicates, norms spanning 1e-6 … 1e6, spans of rank 1, 8, 16, 32 and 64, of rank ``3K/8``,
``9K/16`` (a thin dual cone), ``3K/4`` and ``7K/8``, all aligned, half zero, a mix, and the
per-sample gradients of an MLP classifier, at its initialisation and trained) and
writes one table per K, a column per kind. ``--seed`` draws other rows (default: the seed
is K).

Writes ``results/many_tasks_<name>.md`` and ``.json``; see ``docs/performance.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gradbalance.balancers import BALANCERS, Balancer, Constant
from gradbalance.gramian import compute_gramian

Call = Callable[[], object]


def conflicting_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``[K, P]`` float32: ``aᵢ s + nᵢ/2``, ``aᵢ ~ N(0, 1)`` (signs conflict), ``s``, ``nᵢ``
    standard normal."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(p, generator=gen)
    scale = torch.randn(k, 1, generator=gen)
    noise = torch.randn(k, p, generator=gen)
    return (scale * shared + 0.5 * noise).contiguous()


def rank_deficient_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``[K, P]`` float32 rows in a rank-8 span: adjacent pairs 1e-6 apart (relative), each row
    then scaled by one of ``logspace(-6, 6, K)`` (norms spanning 1e-6 … 1e6)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, 8, generator=gen) @ torch.randn(8, p, generator=gen)
    rows[1::2] = rows[0 : k - 1 : 2] + 1e-6 * torch.randn(k // 2, p, generator=gen)
    scales = torch.logspace(-6, 6, k)[torch.randperm(k, generator=gen)]
    return (rows * scales[:, None]).contiguous()


def near_duplicate_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``[K, P]`` float32: each row one of 4 random directions plus ``1e-6`` relative noise
    (``K/4`` near-copies of each task)."""
    gen = torch.Generator().manual_seed(seed)
    dirs = torch.randn(4, p, generator=gen)
    pick = torch.randint(0, 4, (k,), generator=gen)
    return (dirs[pick] + 1e-6 * torch.randn(k, p, generator=gen)).contiguous()


def wide_norm_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """The conflicting rows, each scaled by one of ``logspace(-6, 6, K)`` (shuffled)."""
    gen = torch.Generator().manual_seed(seed + 1)
    scales = torch.logspace(-6, 6, k)[torch.randperm(k, generator=gen)]
    return (conflicting_rows(k, p, seed) * scales[:, None]).contiguous()


def span_rows(rank: int) -> Callable[[int, int, int], torch.Tensor]:
    """``[K, P]`` float32 rows in a random ``rank``-dimensional span (rank 1: ± multiples of
    one direction, every pair aligned or opposed)."""
    def make(k: int, p: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(k, rank, generator=gen) @ torch.randn(rank, p, generator=gen))
    make.__doc__ = span_rows.__doc__
    return make


def span_fraction_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``[K, P]`` float32 rows in a random span of rank ``3K/8`` (above the low-rank route's
    ``K/4``; their conic hull is the span with probability near 1, Wendel 1962)."""
    return span_rows(3 * k // 8)(k, p, seed)


def span_part(numerator: int, denominator: int) -> Callable[[int, int, int], torch.Tensor]:
    """``[K, P]`` float32 rows in a random span of rank ``numerator·K/denominator`` (a few
    rounding-level eigenvalues of the float32 Gramian, near ``K``: the rank-deficient Gramians
    that a lift takes)."""
    def make(k: int, p: int, seed: int) -> torch.Tensor:
        return span_rows(numerator * k // denominator)(k, p, seed)
    make.__doc__ = f"Rows in a random span of rank {numerator}K/{denominator}."
    return make


def thin_cone_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``[K, P]`` float32 rows in a random span of rank ``9K/16``, just above half: their
    conic hull is not the span (with probability near 1 at K = 256, Wendel 1962), so the dual
    cone is a thin one and UPGrad's projections are neither zero nor easy."""
    return span_rows(9 * k // 16)(k, p, seed)


def aligned_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``[K, P]`` float32: ``aᵢ s + nᵢ/2`` with ``aᵢ = 1 + |N(0, 1)|`` (no conflict: every
    entry of the Gramian positive)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(p, generator=gen)
    scale = 1 + torch.randn(k, 1, generator=gen).abs()
    return (scale * shared + 0.5 * torch.randn(k, p, generator=gen)).contiguous()


def half_zero_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """The conflicting rows with a random half of them zero (tasks without a gradient)."""
    rows = conflicting_rows(k, p, seed)
    gen = torch.Generator().manual_seed(seed + 2)
    rows[torch.randperm(k, generator=gen)[: k // 2]] = 0.0
    return rows


def mixed_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """Every other kind at once: ``K/6`` rows of each (conflicting, near duplicates, wide
    norms, rank 1, aligned, zero), shuffled."""
    makers = [conflicting_rows, near_duplicate_rows, wide_norm_rows, span_rows(1),
              aligned_rows]
    sizes = [k // 6] * 5
    parts = [make(n, p, seed + i) for i, (make, n) in enumerate(zip(makers, sizes, strict=True))]
    parts.append(torch.zeros(k - sum(sizes), p))
    gen = torch.Generator().manual_seed(seed + 3)
    return torch.cat(parts)[torch.randperm(k, generator=gen)].contiguous()


def randn_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``[K, P]`` float32 ``torch.randn`` rows (no shared direction: one Marchenko–Pastur
    bulk)."""
    return torch.randn(k, p, generator=torch.Generator().manual_seed(seed))


def wide_randn_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """The ``torch.randn`` rows, each scaled by one of ``logspace(-6, 6, K)`` (shuffled): norms
    spanning 1e-6 … 1e6 without a shared direction (the cosine matrix well conditioned, the
    Gramian's condition number about 1e24)."""
    gen = torch.Generator().manual_seed(seed + 1)
    scales = torch.logspace(-6, 6, k)[torch.randperm(k, generator=gen)]
    return (randn_rows(k, p, seed) * scales[:, None]).contiguous()


def equal_norm_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """The conflicting rows scaled to one norm (the same directions; their norms, not their
    angles, made the conflicting rows' projections easier)."""
    rows = conflicting_rows(k, p, seed)
    return rows / torch.linalg.vector_norm(rows, dim=1, keepdim=True)


def square_mixing_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``C B / √K``: ``K`` rows mixing ``K`` Gaussian directions by a Gaussian ``[K, K]``
    ``C`` (full rank, condition number near ``K²``: small eigenvalues throughout)."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(k, p, generator=gen)
    return torch.randn(k, k, generator=gen) @ basis / k**0.5


def dependent_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """The conflicting rows with the last ``K/16`` replaced by sums of two others (tasks
    that are combinations of others: a Gramian of rank ``15K/16``)."""
    rows = conflicting_rows(k, p, seed)
    extra = max(k // 16, 1)
    gen = torch.Generator().manual_seed(seed + 5)
    pairs = torch.randint(0, k - extra, (extra, 2), generator=gen)
    rows[k - extra:] = rows[pairs[:, 0]] + rows[pairs[:, 1]]
    return rows


def noisy_span(numerator: int, denominator: int,
               noise: float) -> Callable[[int, int, int], torch.Tensor]:
    """``[K, P]`` float32 rows in a random span of rank ``numerator·K/denominator`` plus
    Gaussian noise ``noise`` times their size: full rank, the Gramian's smallest eigenvalues
    all near ``noise²`` of its mean (a condition number near 1e5 … 1e7)."""
    def make(k: int, p: int, seed: int) -> torch.Tensor:
        rank = max(numerator * k // denominator, 1)
        gen = torch.Generator().manual_seed(seed)
        basis = torch.randn(k, rank, generator=gen) @ torch.randn(rank, p, generator=gen)
        return (basis / rank**0.5 + noise * torch.randn(k, p, generator=gen)).contiguous()
    make.__doc__ = (f"Rows in a random span of rank {numerator}K/{denominator} plus noise "
                    f"{noise:g} of their size.")
    return make


def all_but_one_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``[K, P]`` float32 rows in a random span of rank ``K − 1`` (one task a combination of
    the others; the Gramian's small eigenvalues spread down to its rounding)."""
    return span_rows(k - 1)(k, p, seed)


def duplicate_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``K/2`` Gaussian rows each given twice, shuffled (tasks that are copies of others: a
    Gramian of rank ``K/2`` whose copies' cosines are 1 within the rounding)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k - k // 2, p, generator=gen)
    both = torch.cat([rows, rows[: k // 2]])
    return both[torch.randperm(k, generator=gen)].contiguous()


def longer_copy_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``K/2`` Gaussian rows and each one doubled in length (parallel pairs of unequal norm)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k - k // 2, p, generator=gen)
    return torch.cat([rows, 2.0 * rows[: k // 2]]).contiguous()


def few_copy_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``K`` Gaussian rows, the first ``K/16`` replaced by copies of the next ``K/16``."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k, p, generator=gen)
    extra = max(k // 16, 1)
    rows[:extra] = rows[extra : 2 * extra]
    return rows


def conflicting_copy_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """The conflicting rows of ``K/2`` tasks, each given twice."""
    rows = conflicting_rows(k - k // 2, p, seed)
    return torch.cat([rows, rows[: k // 2]]).contiguous()


def wide_copy_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """``K/2`` Gaussian rows each given twice, every row scaled by ``c·2^e`` (``c`` uniform
    in ``[1, 2)``, ``e`` from −20 to 20; shuffled): copies at norms 12 decades apart, whose
    cosines are 1 only to the float32 product's rounding."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(k - k // 2, p, generator=gen)
    scales = (1.0 + torch.rand(k, generator=gen)) * torch.pow(
        2.0, torch.randint(-20, 21, (k,), generator=gen).float())
    both = torch.cat([rows, rows[: k // 2]]) * scales[:, None]
    return both[torch.randperm(k, generator=gen)].contiguous()


def float64_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """The conflicting rows in float64 (the Gramian and the solvers in float64)."""
    return conflicting_rows(k, p, seed).double()


Layers = list[tuple[torch.Tensor, torch.Tensor]]


def _classifier(p: int, gen: torch.Generator) -> Layers:
    """An MLP classifier ``32 → h → h → 10`` (``h`` the largest width with at most ``P``
    parameters) at its initialisation, as ``(weight, bias)`` pairs."""
    width = max(int(((44.0**2 + 4.0 * max(p - 10, 0)) ** 0.5 - 44.0) / 2.0), 1)
    sizes = [(32, width), (width, width), (width, 10)]
    return [(torch.randn(o, i, generator=gen) / i**0.5, torch.randn(o, generator=gen) * 0.1)
            for i, o in sizes]


def _per_sample_gradients(layers: Layers, x: torch.Tensor, labels: torch.Tensor,
                          p: int) -> torch.Tensor:
    """``[K, P]``: each sample's gradient of the cross-entropy, by hand (``d loss / d W =
    back ⊗ input`` per layer), zero columns up to ``P``."""
    k = x.shape[0]
    inputs, pre = [x], []
    for j, (w, b) in enumerate(layers):
        pre.append(inputs[-1] @ w.T + b)
        if j < len(layers) - 1:
            inputs.append(torch.relu(pre[-1]))
    back = torch.softmax(pre[-1], dim=1) - torch.nn.functional.one_hot(labels, 10).float()
    parts = []
    for j in reversed(range(len(layers))):
        parts.append(torch.cat([(back[:, :, None] * inputs[j][:, None, :]).reshape(k, -1),
                                back], dim=1))
        if j > 0:
            back = (back @ layers[j][0]) * (pre[j - 1] > 0)
    rows = torch.cat(parts[::-1], dim=1)[:, :p]
    return torch.nn.functional.pad(rows, (0, p - rows.shape[1])).contiguous()


def per_sample_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """The per-sample gradients of ``K`` samples (Gaussian inputs, random labels among 10
    classes) of an MLP classifier ``32 → h → h → 10`` at its initialisation (the rows of
    per-sample objectives, docs/per_sample.md: the classes' nine directions stand out of a
    spectrum that falls gradually, the cosine matrix's condition number in the hundreds)."""
    gen = torch.Generator().manual_seed(seed)
    layers = _classifier(p, gen)
    x = torch.randn(k, 32, generator=gen)
    return _per_sample_gradients(layers, x, torch.randint(0, 10, (k,), generator=gen), p)


def trained_per_sample_rows(k: int, p: int, seed: int) -> torch.Tensor:
    """As :func:`per_sample_rows` after 300 Adam steps (batches of 128, learning rate 1e-3) on
    labels a random linear teacher gives: samples the network fits have small gradients
    (norms spanning 1e6 and more), the bulk's condition number in the thousands."""
    gen = torch.Generator().manual_seed(seed)
    layers = [(w.requires_grad_(), b.requires_grad_()) for w, b in _classifier(p, gen)]
    teacher = torch.randn(10, 32, generator=gen)
    data = torch.randn(4096, 32, generator=gen)
    labels = (data @ teacher.T).argmax(dim=1)
    opt = torch.optim.Adam([t for layer in layers for t in layer], lr=1e-3)
    for _ in range(300):
        batch = torch.randint(0, 4096, (128,), generator=gen)
        h = data[batch]
        for j, (w, b) in enumerate(layers):
            h = h @ w.T + b
            h = torch.relu(h) if j < len(layers) - 1 else h
        loss = torch.nn.functional.cross_entropy(h, labels[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
    fixed = [(w.detach(), b.detach()) for w, b in layers]
    return _per_sample_gradients(fixed, data[:k], labels[:k], p)


KINDS = {"conflicting": conflicting_rows, "rank8": rank_deficient_rows,
         "near_duplicates": near_duplicate_rows, "wide_norms": wide_norm_rows,
         "rank1": span_rows(1), "span8": span_rows(8), "aligned": aligned_rows,
         "half_zero": half_zero_rows, "mixed": mixed_rows, "span16": span_rows(16),
         "span32": span_rows(32), "span64": span_rows(64), "randn": randn_rows,
         "float64": float64_rows, "wide_randn": wide_randn_rows, "equal_norms": equal_norm_rows,
         "square_mixing": square_mixing_rows, "dependent": dependent_rows,
         "span_3k8": span_fraction_rows, "span_9k16": thin_cone_rows,
         "span_3k4": span_part(3, 4), "span_7k8": span_part(7, 8),
         "span_1k2": span_part(1, 2), "span_5k8": span_part(5, 8),
         "noisy_half": noisy_span(1, 2, 1e-2), "noisy_quarter": noisy_span(1, 4, 1e-3),
         "span_k1": all_but_one_rows, "span_9k10": span_part(9, 10),
         "span_3k5": span_part(3, 5), "duplicates": duplicate_rows,
         "longer_copies": longer_copy_rows, "few_copies": few_copy_rows,
         "conflicting_copies": conflicting_copy_rows, "wide_copies": wide_copy_rows,
         "per_sample": per_sample_rows, "per_sample_trained": trained_per_sample_rows}


def make_balancer(name: str, k: int) -> Balancer:
    """The balancer with its defaults (Constant: equal weights)."""
    if name == "constant":
        return Constant(torch.full((k,), 1.0 / k))
    return BALANCERS[name]()


def torchjd_calls(matrix: torch.Tensor) -> dict[str, Call]:
    """TorchJD's aggregators on the same matrix (empty without TorchJD)."""
    try:
        from torchjd import aggregation
    except ImportError:
        return {}
    names = ["UPGrad", "DualProj", "PCGrad", "MGDA"]
    out: dict[str, Call] = {}
    for name in names:
        agg = getattr(aggregation, name, None)
        if agg is not None:
            inst = agg()
            out[f"torchjd:{name}"] = lambda inst=inst: inst(matrix)
    return out


def calls_at(k: int, p: int, names: list[str], torchjd: bool,
             kind: str = "conflicting", seed: int | None = None) -> dict[str, Call]:
    """Every method to time at this K, the Gramian first (the rows and losses drawn with
    ``seed``, default ``K``)."""
    seed = k if seed is None else seed
    matrix = KINDS[kind](k, p, seed=seed)
    losses = torch.rand(k, generator=torch.Generator().manual_seed(seed)) + 0.5
    calls: dict[str, Call] = {"gramian": lambda: compute_gramian(matrix),
                              "J Jᵀ float32": lambda: matrix @ matrix.T}
    for name in names:
        bal = make_balancer(name, k)
        arg = losses if bal.needs_losses else None
        calls[name] = lambda bal=bal, arg=arg: bal.combine(matrix, arg)
    if torchjd:
        calls.update(torchjd_calls(matrix))
    return calls


#: The clock of :func:`time_k`: wall time, or this process's CPU time (``--clock cpu``: on a
#: shared machine, what each call itself costs).
CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def time_k(calls: dict[str, Call], rounds: int, budget: float) -> dict[str, float | str]:
    """Median seconds per method over interleaved rounds (a first call warms each up)."""
    times: dict[str, list[float]] = {n: [] for n in calls}
    result: dict[str, float | str] = {}
    names = list(calls)
    for r in range(rounds + 1):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            if name in result:
                continue
            start = _clock()
            try:
                out = calls[name]()
            except Exception as exc:
                result[name] = f"error: {type(exc).__name__}"
                continue
            elapsed = _clock() - start
            if not finite(out):
                result[name] = "not finite"
                continue
            if r > 0 or elapsed > budget:
                times[name].append(elapsed)
            if elapsed > budget:
                result[name] = statistics.median(times[name])
    for name, ts in times.items():
        if name not in result:
            result[name] = statistics.median(ts)
    return {name: result[name] for name in calls}  # in the calls' order, the Gramian first


def finite(out: object) -> bool:
    """Whether a call's result (a tensor, a Combination or TorchJD's vector) is finite."""
    vector = getattr(out, "vector", out)
    return not isinstance(vector, torch.Tensor) or bool(torch.isfinite(vector).all())


def table(ks: list[int], rows: dict[str, dict[int, float | str]]) -> str:
    """Markdown: ms and multiple of the Gramian per method and K."""
    head = "| method | " + " | ".join(f"K={k}" for k in ks) + " |"
    lines = [head, "|---" * (len(ks) + 1) + "|"]
    for name, per_k in rows.items():
        cells = []
        for k in ks:
            v, g = per_k.get(k, "—"), rows["gramian"].get(k)
            if isinstance(v, float) and isinstance(g, float):
                ratio = "" if name == "gramian" else f" ({v / g:.1f}×)"
                cells.append(f"{v * 1e3:.1f} ms{ratio}")
            else:
                cells.append(str(v))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def kinds_table(k: int, kinds: list[str], res: dict[str, dict[str, float | str]]) -> str:
    """Markdown at one K: a row per method, a column per kind; the Gramian in ms, every other
    method as a multiple of the Gramian (``compute_gramian``) of the same kind and run, and
    in brackets of the plain product ``J Jᵀ``."""
    lines = ["| method | " + " | ".join(kinds) + " |", "|---" * (len(kinds) + 1) + "|"]
    names = list(dict.fromkeys(n for kind in kinds for n in res[kind]))
    for name in names:
        cells = []
        for kind in kinds:
            v, g = res[kind].get(name, "—"), res[kind].get("gramian")
            plain = res[kind].get("J Jᵀ float32")
            if isinstance(v, float) and isinstance(g, float):
                cell = f"{v * 1e3:.0f} ms" if name == "gramian" else f"{v / g:.2f}×"
                if isinstance(plain, float) and name not in ("gramian", "J Jᵀ float32"):
                    cell += f" ({v / plain:.2f}×)"
                cells.append(cell)
            else:
                cells.append(str(v))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep(args: argparse.Namespace, ks: list[int], names: list[str], kinds: list[str],
          out: Path) -> str:
    """Every kind at every K (``--kinds``): one table per K, the load average per kind; the
    file is rewritten after each kind (a long run keeps what it has measured)."""
    res: dict[int, dict[str, dict[str, float | str]]] = {k: {} for k in ks}
    loads: list[str] = []
    text = ""
    for done, kind in enumerate(kinds):
        for k in ks:
            calls = calls_at(k, args.p, names, not args.no_torchjd, kind, args.seed)
            res[k][kind] = time_k(calls, args.rounds, args.budget)
            print(f"{kind} K={k} done", flush=True)
        loads.append(f"{kind} {os.getloadavg()[0]:.1f}")
        ran = kinds[: done + 1]
        text = ("# Combine time by kind of rows, as a multiple of the Gramian (in brackets: of"
                " the plain product J Jᵀ)\n") + "".join(
            f"\n## K = {k} ({', '.join(ran)}; P = {args.p}, seed "
            f"{k if args.seed is None else args.seed}, float32, {args.threads} "
            f"thread(s), median of {args.rounds} interleaved rounds, {args.clock} clock)\n\n"
            + kinds_table(k, ran, res[k]) + "\n"
            for k in ks
        ) + f"\nLoad average (1 min) after each kind: {', '.join(loads)}.\n"
        (out / f"many_tasks_{args.name}.md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="8,16,32,64,128,256,512,1024")
    parser.add_argument("--p", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=20.0, help="seconds per call")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated balancer names")
    parser.add_argument("--no-torchjd", action="store_true")
    parser.add_argument("--kind", default="conflicting", choices=sorted(KINDS),
                        help="rank8: rows in a rank-8 span, near duplicates, norms 1e-6 … 1e6")
    parser.add_argument("--kinds", default="",
                        help="comma-separated kinds or 'all': a table per K, a column per kind")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the rows and losses (default: K, one draw per K)")
    parser.add_argument("--name", default="cpu")
    parser.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                        help="wall time (default) or the process's CPU time")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global _clock
    _clock = CLOCK[args.clock]
    ks = [int(k) for k in args.ks.split(",")]
    names = [n for n in BALANCERS if not args.only or n in args.only.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.kinds:
        kinds = list(KINDS) if args.kinds == "all" else args.kinds.split(",")
        print(sweep(args, ks, names, kinds, out))
        return
    rows: dict[str, dict[int, float | str]] = {}
    cut: set[str] = set()
    for k in ks:
        calls = {n: c for n, c in calls_at(k, args.p, names, not args.no_torchjd,
                                                   args.kind, args.seed).items()
                 if n not in cut}
        for name, value in time_k(calls, args.rounds, args.budget).items():
            rows.setdefault(name, {})[k] = value
            if not isinstance(value, float) or value > args.budget / 8:
                cut.add(name)
        for name in cut:
            rows.setdefault(name, {}).setdefault(k, "cut")
        print(f"K={k} done", flush=True)
    text = (f"# Combine time vs K ({args.kind} rows, P = {args.p}, float32, {args.threads} "
            f"thread(s), "
            f"median of {args.rounds} interleaved rounds, budget {args.budget} s, {args.clock} "
            "clock)\n\n"
            + table(ks, rows) + "\n")
    (out / f"many_tasks_{args.name}.md").write_text(text)
    (out / f"many_tasks_{args.name}.json").write_text(json.dumps(
        {n: {str(k): v for k, v in r.items()} for n, r in rows.items()}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
