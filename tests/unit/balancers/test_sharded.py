"""Balancers on a sharded trunk: ``combine_sharded`` on each rank's columns, concatenated over
the ranks, equals the single-process ``combine`` on the full matrix.

The expected value is always the single-process ``combine``. R ranks run in R threads whose
``Shard.reduce`` is a barrier-synchronised sum (``support.sharded.ThreadGroup``); the columns
are split as FSDP2 splits parameters on dim 0, or at random (uneven, out of order, some ranks
empty). One test repeats the check on two real gloo processes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import gradbalance
from gradbalance import NonFiniteGradientError
from gradbalance.balancers import (
    DBMTL,
    Balancer,
    Combination,
    ExcessMTL,
    GradDrop,
    GradVac,
    MoCo,
    Shard,
    dim0_runs,
)
from gradbalance.balancers import _graddrop as graddrop_module
from gradbalance.functional import compute_gramian, graddrop_update
from support.balancers import build_balancer
from support.ddp import spawn_bounded
from support.declared_state import modules
from support.sharded import (
    GLOO_SHAPES,
    Runs,
    ThreadGroup,
    columns,
    fsdp_splits,
    gather,
    gloo_balancers,
    gloo_matrices,
    gloo_worker,
    random_splits,
)

Maker = Callable[[int, int, int], Balancer]  # (K, P, seed) -> a fresh balancer

#: Settings of the matrix balancers that change what is summed over ranks.
VARIANTS: dict[str, Maker] = {
    "gradvac-groups": lambda k, p, s: GradVac(
        k, groups=_groups(p, s), beta=0.5, generator=torch.Generator().manual_seed(s)),
    "dbmtl-log-losses": lambda k, p, s: DBMTL(k, beta_sigma=0.5, log_losses=True),
    "moco-normalized-softmax": lambda k, p, s: MoCo(k, normalize_grads=True,
                                                    lambda_update="softmax", rho=0.1),
    "excessmtl-warmup": lambda k, p, s: ExcessMTL(k, n_warmup_steps=1),
    "graddrop-leak": lambda k, p, s: GradDrop(
        leak=[0.25 * (i % 3) for i in range(k)], f=torch.sqrt,
        generator=torch.Generator().manual_seed(s)),
}

MAKERS: dict[str, Maker] = {
    **{name: (lambda k, p, s, name=name: build_balancer(name, k, s))
       for name in sorted(gradbalance.BALANCERS)},
    **VARIANTS,
}
NAMES = sorted(MAKERS)

TOL = {torch.float32: 1e-6, torch.float64: 1e-12}
STEPS = 3


def _groups(p: int, seed: int) -> list[int]:
    """A random composition of ``p`` into positive group sizes."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted({int(c) for c in torch.randint(1, p, (3,), generator=gen)} if p > 1 else set())
    edges = [0, *cuts, p]
    return [b - a for a, b in itertools.pairwise(edges)]


def _shapes(p: int, gen: torch.Generator) -> list[tuple[int, ...]]:
    """Parameter shapes with ``p`` elements in all (random sizes, 1-d and 2-d)."""
    shapes: list[tuple[int, ...]] = []
    left = p
    while left:
        n = int(torch.randint(1, left + 1, (), generator=gen))
        cols = [c for c in (1, 2, 3) if n % c == 0][-1] if n > 1 else 1
        shapes.append((n // cols, cols) if cols > 1 else (n,))
        left -= n
    return shapes


def _matrices(k: int, p: int, seed: int, dtype: torch.dtype, dyadic: bool = False
              ) -> list[Tensor]:
    """``STEPS`` matrices ``[K, P]``; ``dyadic``: entries are multiples of 1/8 below 32, so
    every product and every sum of up to 64 of them is exact in float32: the Gramian is the
    same in any summation order and a comparison checks the sharding, not how a solver near
    a singular Gramian (K > P) amplifies rounding."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        g = torch.randn(k, p, generator=gen, dtype=torch.float64)
        g[-1] -= 0.8 * g[0]  # a conflict, so the projecting methods have work to do
        if dyadic:
            g = (g * 8).round().clamp(-255, 255) / 8
        out.append(g.to(dtype))
    return out


def _losses(k: int, seed: int) -> Tensor:
    return torch.rand(k, generator=torch.Generator().manual_seed(seed + 1),
                      dtype=torch.float64) + 0.5


def _close(found: Tensor, expected: Tensor, tol: float, what: str, floor: float = 0.0) -> None:
    diff = float((found.double() - expected.double()).norm())
    scale = float(expected.double().norm())
    assert diff <= tol * scale + floor or diff == 0.0, (
        f"{what}: |diff| {diff:.3e}, |expected| {scale:.3e}")


def _terms_rounding(g: Tensor, weights: Tensor | None) -> float:
    """The rounding of an update ``Σ wₖgₖ`` in ``g``'s dtype, ``K eps Σ|wₖ|‖gₖ‖``; without
    weights (DB-MTL's rows scaled to the longest, GradDrop's masked ones) ``K eps`` times
    ``K`` terms of at most the longest row's norm. An update that cancels to it is zero to
    both runs (DB-MTL with log losses, K = 4, P = 1, float32: unit rows ``±1`` summing to 0,
    5.8e-8 in one run, 0 in the other)."""
    k, eps = g.shape[0], torch.finfo(g.dtype).eps
    norms = g.double().norm(dim=1)
    if weights is None:
        return k * eps * k * float(norms.max())
    return k * eps * float(weights.double().abs() @ norms)


def _per_column(balancer: Balancer) -> set[str]:
    """The state keys declared ``like_rows``: one value per column, a rank keeps its own."""
    return {f"{prefix}{name}" for prefix, module in modules(balancer)
            for name, spec in module.state_specs.items() if spec.like_rows}


def _same_state(single: Any, ranks: list[Any], splits: list[Runs], tol: float,
                per_column: set[str], key: str = "state", columns: bool = False) -> None:
    """Each rank's state equals the single process's: per-column entries after gathering the
    ranks' columns, everything else on every rank (generators bit for bit)."""
    if isinstance(single, dict):
        for rank_state in ranks:
            assert set(rank_state) == set(single), key
        for name in single:
            _same_state(single[name], [r[name] for r in ranks], splits, tol, per_column,
                        f"{key}.{name}", name in per_column)
    elif isinstance(single, Tensor) and columns:
        _close(gather(ranks, splits, single.shape[-1]), single, tol, key)
    elif isinstance(single, Tensor) and not single.is_floating_point():
        for rank_state in ranks:
            assert torch.equal(rank_state, single), key
    elif isinstance(single, Tensor):
        for rank_state in ranks:
            _close(rank_state, single, tol, key)
    else:
        assert all(r == single for r in ranks), key


def _equal_state(found: Any, expected: Any) -> None:
    """Bit-identical states (nested dicts of tensors and plain values)."""
    if isinstance(expected, dict):
        assert set(found) == set(expected)
        for name in expected:
            _equal_state(found[name], expected[name])
    elif isinstance(expected, Tensor):
        assert torch.equal(found, expected)
    else:
        assert found == expected


def _run_sharded(make: Callable[[], Balancer], matrices: list[Tensor], losses: Tensor,
                 splits: list[Runs], given_gramian: bool) -> tuple[list[Balancer], list[Any]]:
    """Every rank's balancer and its ``Combination`` per step (or the exception raised)."""
    total = matrices[0].shape[1]
    group = ThreadGroup(len(splits))
    balancers = [make() for _ in splits]

    def rank(r: int) -> list[Combination]:
        shard, idx = group.shard(r, splits[r], total), columns(splits[r])
        return [balancers[r].combine_sharded(
            g[:, idx], shard, losses, compute_gramian(g) if given_gramian else None)
            for g in matrices]

    return balancers, group.run(rank)


def check_sharded(name: str, k: int, p: int, splits: list[Runs], dtype: torch.dtype,
                  seed: int, given_gramian: bool = False, dyadic: bool = False) -> None:
    """``combine_sharded`` over ``splits`` equals ``combine`` on the full matrices, step by
    step (update, weights) and in the state after the last step. Where the single process
    raises (e.g. a solver with no solution), every rank raises the same error at that step."""
    tol = TOL[dtype]
    matrices, losses = _matrices(k, p, seed, dtype, dyadic), _losses(k, seed)

    def make() -> Balancer:
        return MAKERS[name](k, p, seed)

    single = make()
    expected: list[Combination] = []
    failure: Exception | None = None
    for g in matrices:
        try:
            expected.append(single.combine(g, losses))
        except Exception as exc:  # every rank must raise it too
            failure = exc
            break
    balancers, results = _run_sharded(make, matrices[: len(expected) + (failure is not None)],
                                      losses, splits, given_gramian)
    for result in results:
        if failure is not None:
            assert type(result) is type(failure), (result, failure)
        elif isinstance(result, BaseException):
            raise result
    if failure is not None:
        return
    for step, want in enumerate(expected):
        found = gather([r[step].vector for r in results], splits, p)
        _close(found, want.vector, tol, f"{name} step {step} update",
               _terms_rounding(matrices[step], want.weights))
        for r in results:
            weights = r[step].weights
            assert (weights is None) == (want.weights is None)
            if weights is not None and want.weights is not None:
                _close(weights, want.weights, tol, f"{name} step {step} weights")
    _same_state(single.state_dict(), [b.state_dict() for b in balancers], splits, tol,
                _per_column(single))


# -- every balancer -----------------------------------------------------------------------

def test_every_registered_balancer_runs_sharded() -> None:
    # The engine refuses a balancer before anything moves when `shardable` is False; every
    # balancer the library ships runs sharded (checked for equality below).
    refused = [n for n in NAMES if not MAKERS[n](3, 12, 0).shardable]
    assert refused == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name", NAMES)
def test_fsdp_split_equals_single_process(name: str, dtype: torch.dtype) -> None:
    # Four parameters over three ranks: the (1,) parameter lives on rank 0 only, the (2, 3)
    # one on ranks 0 and 1, so rank 2 holds fewer columns than the others.
    shapes = [(5, 3), (1,), (2, 3), (7,)]
    p = sum(torch.Size(s).numel() for s in shapes)
    check_sharded(name, 4, p, fsdp_splits(shapes, 3), dtype, seed=1)


@pytest.mark.parametrize("name", NAMES)
def test_random_uneven_split_with_the_full_gramian_given(name: str) -> None:
    splits = random_splits(23, 4, torch.Generator().manual_seed(3))
    assert any(len(runs) > 1 for runs in splits)  # some rank's runs are out of order
    check_sharded(name, 3, 23, splits, torch.float64, seed=2, given_gramian=True)


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(NAMES), k=st.integers(3, 5), p=st.integers(1, 40),
       world=st.sampled_from([1, 2, 3, 4]), fsdp=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2**20),
       given_gramian=st.booleans())
def test_property_sharded_equals_single_process(name: str, k: int, p: int, world: int,
                                               fsdp: bool, dtype: torch.dtype, seed: int,
                                               given_gramian: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    splits = (fsdp_splits(_shapes(p, gen), world) if fsdp
              else random_splits(p, world, gen))
    check_sharded(name, k, p, splits, dtype, seed, given_gramian, dyadic=True)


# -- refusal, non-finite input, bad input -------------------------------------------------

class _ColumnMedian(Balancer):
    """A matrix balancer without a sharded path (test-only): the median row by norm."""

    name = "columnmedian"
    from_gramian = False

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _combine_matrix(self, matrix: Tensor, losses: Tensor | None) -> Combination:
        self.calls += 1
        order = matrix.norm(dim=1).argsort()
        return Combination(matrix[order[len(order) // 2]].clone())


def test_a_matrix_balancer_without_a_sharded_path_refuses_before_anything_moves() -> None:
    balancer = _ColumnMedian()
    calls: list[Tensor] = []
    shard = Shard(((0, 4),), 8, lambda t: calls.append(t) or t.clone())
    assert not balancer.shardable
    with pytest.raises(TypeError, match=r"_ColumnMedian .*weighted balancer.*mode='features'"):
        balancer.check_shardable()
    with pytest.raises(TypeError, match=r"_ColumnMedian .*weighted balancer.*mode='features'"):
        balancer.combine_sharded(torch.randn(3, 4), shard)
    assert balancer.calls == 0 and calls == []


@pytest.mark.parametrize("name", ["dbmtl", "moco", "excessmtl", "graddrop", "gradvac-groups",
                                  "pcgrad", "nashmtl", "fairgrad"])
@pytest.mark.parametrize("given_gramian", [False, True])
def test_inf_on_one_rank_raises_on_every_rank_and_changes_no_state(
        name: str, given_gramian: bool) -> None:
    k, p = 3, 12
    splits = fsdp_splits([(4, 2), (4,)], 2)
    matrices = _matrices(k, p, 0, torch.float64)
    losses = _losses(k, 0)
    balancers, _ = _run_sharded(lambda: MAKERS[name](k, p, 0), matrices[:1], losses, splits,
                                given_gramian)
    before = [b.state_dict() for b in balancers]
    bad = matrices[1].clone()
    bad[1, int(columns(splits[1])[0])] = float("inf")  # a column rank 1 holds
    group = ThreadGroup(2)

    def rank(r: int) -> Combination:
        gram = compute_gramian(bad) if given_gramian else None
        return balancers[r].combine_sharded(bad[:, columns(splits[r])],
                                            group.shard(r, splits[r], p), losses, gram)

    results = group.run(rank)
    assert all(isinstance(e, NonFiniteGradientError) for e in results), results
    for b, state in zip(balancers, before, strict=True):
        _equal_state(b.state_dict(), state)


def test_finite_rows_whose_gramian_overflows_match_the_single_process() -> None:
    # float64 rows of norm ~1e200: ‖g‖² overflows. A weighted balancer raises ValueError (not
    # NonFiniteGradientError) on every rank, as combine() does; a coordinate-wise matrix
    # balancer never needs ‖g‖² and proceeds, as combine() does.
    g = 1e200 * _matrices(3, 10, 0, torch.float64)[0]
    splits = fsdp_splits([(10,)], 2)
    with pytest.raises(ValueError, match="overflow float64"):
        MAKERS["upgrad"](3, 10, 0).combine(g)
    for name in ("upgrad", "trimmedmean"):
        group = ThreadGroup(2)
        balancer = MAKERS[name](3, 10, 0)
        results = group.run(lambda r, b=balancer, grp=group: b.combine_sharded(
            g[:, columns(splits[r])], grp.shard(r, splits[r], 10)))
        if name == "upgrad":
            assert all(isinstance(e, ValueError) and "overflow" in str(e) for e in results)
        else:
            found = gather([c.vector for c in results], splits, 10)
            _close(found, MAKERS[name](3, 10, 0).combine(g).vector, 0.0, name)


def test_bad_input_raises_naming_the_argument() -> None:
    balancer = MAKERS["dbmtl"](3, 8, 0)
    g = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"matrix has 8 columns but the shard's runs"):
        balancer.combine_sharded(g, Shard(((0, 4),), 8))
    with pytest.raises(ValueError, match=r"gramian must be the full \[K, K\]"):
        balancer.combine_sharded(g, Shard.whole(8), gramian=torch.eye(2, dtype=torch.float64))
    with pytest.raises(TypeError, match="shard must be a Shard"):
        balancer.combine_sharded(g, ((0, 8),))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Shard\.reduce must return a tensor shaped like"):
        balancer.combine_sharded(g, Shard(((0, 8),), 8, lambda t: t.sum()))
    with pytest.raises(ValueError, match="overlap at column 3"):
        Shard(((0, 4), (3, 2)), 8)
    with pytest.raises(ValueError, match="outside the 8 columns"):
        Shard(((6, 4),), 8)
    assert "_ema" not in balancer.state_dict()  # nothing moved: no state before a first step


# -- the pieces ---------------------------------------------------------------------------

def test_dim0_runs_hand_derived() -> None:
    # shapes (4,3) (5,) (1,2) over 3 ranks: chunks of 2, 2 and 1 rows. Rank 1: rows 2..3 of
    # the first (columns 6..11), rows 2..3 of the second (12+2 = 14, 2 columns), no row of
    # the third (it has one row, on rank 0).
    assert dim0_runs([(4, 3), (5,), (1, 2)], 1, 3) == ((6, 6), (14, 2), (19, 0))
    assert dim0_runs([(4, 3), (5,), (1, 2)], 0, 3) == ((0, 6), (12, 2), (17, 2))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_dim0_runs_match_torch_chunk(world: int) -> None:
    # torch.chunk on dim 0 is FSDP2's split (then padded): chunk r, if it exists, is rank r's.
    shapes = [(5, 3), (1,), (2, 2, 2), (7,), (3, 1)]
    offset = 0
    expected: list[list[int]] = [[] for _ in range(world)]
    for shape in shapes:
        flat = torch.arange(offset, offset + torch.Size(shape).numel()).reshape(shape)
        for r, part in enumerate(torch.chunk(flat, world, dim=0)):
            expected[r] += part.reshape(-1).tolist()
        offset += flat.numel()
    for r in range(world):
        assert columns(dim0_runs(shapes, r, world)).tolist() == expected[r]


def test_graddrop_draws_in_chunks_replay_the_single_process_stream(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # On the CPU the chunked stream is torch.rand(P) itself; with chunks of 7 columns, ranks
    # whose runs straddle chunk ends, skip whole chunks, or hold nothing, keep their draws.
    k, p = 3, 40
    g = _matrices(k, p, 4, torch.float64)[0]
    whole = graddrop_update(g, torch.rand(p, generator=torch.Generator().manual_seed(9),
                                          dtype=torch.float64))
    torch.testing.assert_close(
        GradDrop(generator=torch.Generator().manual_seed(9)).combine(g).vector, whole,
        rtol=0, atol=0)
    monkeypatch.setattr(graddrop_module, "_DRAW_CHUNK", 7)
    splits = [((30, 5), (2, 3)), ((0, 2), (5, 25)), (), ((35, 5),)]
    parts, states = [], []
    for runs in splits:
        balancer = GradDrop(generator=torch.Generator().manual_seed(9))
        parts.append(balancer.combine_sharded(g[:, columns(runs)], Shard(runs, p)).vector)
        states.append(balancer.generator.get_state())
    torch.testing.assert_close(gather(parts, splits, p), whole, rtol=0, atol=0)
    reference = torch.Generator().manual_seed(9)
    torch.rand(p, generator=reference, dtype=torch.float64)
    assert all(torch.equal(s, reference.get_state()) for s in states)


def test_sharded_state_resumes_bit_identically() -> None:
    # A rank's state_dict (its columns) loaded into a fresh balancer continues the same way.
    k, p = 3, 10
    splits = fsdp_splits([(5, 2)], 2)
    matrices = _matrices(k, p, 6, torch.float64)
    for name in ("dbmtl", "moco", "excessmtl", "gradvac-groups", "graddrop"):
        runs = splits[1]
        shard, idx = Shard(runs, p, lambda t: 2 * t), columns(runs)  # any agreed reduce

        def steps(b: Balancer, ms: list[Tensor], shard: Shard = shard,
                  idx: Tensor = idx) -> list[Tensor]:
            return [b.combine_sharded(m[:, idx], shard).vector for m in ms]

        first = MAKERS[name](k, p, 0)
        steps(first, matrices[:1])
        resumed = MAKERS[name](k, p, 0)
        resumed.load_state_dict(first.state_dict())
        for a, b in zip(steps(first, matrices[1:]), steps(resumed, matrices[1:]), strict=True):
            assert torch.equal(a, b), name


# -- two real ranks -----------------------------------------------------------------------

def test_two_gloo_ranks_match_the_single_process() -> None:
    ranks = spawn_bounded(gloo_worker, world=2, limit_s=120)
    matrices = gloo_matrices()
    p = matrices[0].shape[1]
    splits = [r["runs"] for r in ranks]
    assert splits == fsdp_splits(GLOO_SHAPES, 2)
    for name, single in gloo_balancers().items():
        expected = [single.combine(g) for g in matrices]
        for step, want in enumerate(expected):
            found = gather([r[name]["vectors"][step] for r in ranks], splits, p)
            _close(found, want.vector, TOL[torch.float32], f"{name} step {step}")
            for r in ranks:
                weights = r[name]["weights"][step]
                assert (weights is None) == (want.weights is None)
                if weights is not None and want.weights is not None:
                    _close(weights, want.weights, TOL[torch.float32], f"{name} weights")
        _same_state(single.state_dict(), [r[name]["state"] for r in ranks], splits, 0.0,
                    _per_column(single))


@pytest.mark.parametrize(("name", "given_gramian", "reduces"), [
    ("upgrad", True, 0), ("upgrad", False, 1), ("pcgrad", False, 1), ("graddrop", True, 0),
    ("trimmedmean", True, 0), ("dbmtl", True, 1), ("excessmtl", True, 1), ("moco", True, 1),
    ("moco-normalized-softmax", True, 2), ("gradvac-groups", True, 1), ("dbmtl", False, 2),
])
def test_collectives_per_step(name: str, given_gramian: bool, reduces: int) -> None:
    # A step's collectives: the Gramian's (when not given) and what the method sums itself
    # (DB-MTL's norms, ExcessMTL's risks, MoCo's Y Yᵀ, GradVac's group Gramians in one call).
    k, p = 3, 12
    splits = fsdp_splits([(6, 2)], 2)
    g = _matrices(k, p, 0, torch.float64)[0]
    group = ThreadGroup(2)
    balancers = [MAKERS[name](k, p, 0) for _ in splits]
    results = group.run(lambda r: balancers[r].combine_sharded(
        g[:, columns(splits[r])], group.shard(r, splits[r], p), _losses(k, 0),
        compute_gramian(g) if given_gramian else None))
    assert all(isinstance(c, Combination) for c in results), results
    assert group.calls == reduces
