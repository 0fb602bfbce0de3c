"""CAGrad's root search where its QPs are decided by rounding: the cosine route's search on
a singular cut factor gives up at the first value of ``f`` outside its bracket's ends
(``_cagrad_root.Bracket.inconsistent``, ``strict``), and the search on the Gramian answers.

Rows of every kind at once (a sixth each: conflicting, near copies of four directions 1e-6
apart, norms spread over 1e-3 … 1e3, one direction with both signs, aligned, zero): the
update against the primal as an SOCP by Clarabel (``test_cagrad_scaled.py``'s reference and
checks), and the root search's contract on a synthetic ``f``.
"""

from __future__ import annotations

import pytest
import torch

from gradbalance.balancers import CAGrad, _cagrad_root
from gradbalance.balancers._cagrad_root import InconsistentRoot, cagrad_root
from support.balancers import check_cagrad_zero_optimum

from .test_cagrad_singular_scaled import _check

F64 = torch.float64


def _every_kind(k: int, p: int, seed: int, pairs: bool = False) -> torch.Tensor:
    """``[K, P]`` float64: ``K/6`` rows of each kind (module docstring), shuffled; with
    ``pairs`` the zero rows replaced by tasks and their reversals (``g``, ``−1.5g``)."""
    gen = torch.Generator().manual_seed(seed)
    n = k // 6

    def conflicting(rows: int) -> torch.Tensor:
        shared = torch.randn(p, generator=gen, dtype=F64)
        return (torch.randn(rows, 1, generator=gen, dtype=F64) * shared
                + 0.5 * torch.randn(rows, p, generator=gen, dtype=F64))

    dirs = torch.randn(4, p, generator=gen, dtype=F64)
    near = dirs[torch.randint(0, 4, (n,), generator=gen)] + 1e-6 * torch.randn(
        n, p, generator=gen, dtype=F64)
    wide = conflicting(n) * torch.logspace(-3, 3, n, dtype=F64)[torch.randperm(n, generator=gen),
                                                                    None]
    one = torch.randn(n, 1, generator=gen, dtype=F64) * torch.randn(1, p, generator=gen,
                                                                     dtype=F64)
    shared = torch.randn(p, generator=gen, dtype=F64)
    aligned = ((1 + torch.randn(n, 1, generator=gen, dtype=F64).abs()) * shared
               + 0.5 * torch.randn(n, p, generator=gen, dtype=F64))
    rest = torch.zeros(k - 5 * n, p, dtype=F64)
    if pairs:
        tasks = torch.randn((k - 5 * n + 1) // 2, p, generator=gen, dtype=F64)
        rest = torch.cat([tasks, -1.5 * tasks])[: k - 5 * n]
    rows = torch.cat([conflicting(n), near, wide, one, aligned, rest])
    return rows[torch.randperm(k, generator=gen)]


@pytest.mark.parametrize(("k", "seed"), [(24, 1), (48, 6), (64, 10)])
def test_rows_of_every_kind_give_the_primals_update(k: int, seed: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Cases whose cosine-route search meets a value outside its bracket (counted): the
    update is the primal's all the same (the search on the Gramian). Reversal pairs, not
    zero rows: with a zero row an optimum of 0 is found without the dual (its projection),
    and below 0 these searches met no such value."""
    seen: list[bool] = []
    real = _cagrad_root.Bracket.inconsistent

    def counted(self: _cagrad_root.Bracket, f_mid: float) -> bool:
        seen.append(real(self, f_mid))
        return seen[-1]

    monkeypatch.setattr(_cagrad_root.Bracket, "inconsistent", counted)
    rows = _every_kind(k, 4 * k, seed, pairs=True)
    assert _check(rows, 0.4)
    assert any(seen)


@pytest.mark.parametrize(("k", "seed"), [(24, 2), (48, 3), (48, 6), (64, 0), (64, 13)])
def test_weights_left_beside_zero_rows_are_the_zero_optimum(k: int, seed: int) -> None:
    """Cases whose optimum is 0 (the ball reaches an update that conflicts with no task):
    the dual's weights sit on the zero rows but for ``1e-8 … 3e-7`` on the shortest rows,
    whose combination was taken for ``g_w`` (an update on the ball's surface with a task at
    cosine down to −0.047); the update is the conflict-free one closest to ``g₀``
    (scipy's NNLS projection)."""
    rows = _every_kind(k, 4 * k, seed)
    assert check_cagrad_zero_optimum(rows, CAGrad(c=0.4)(rows), 1e-7)


def _problem() -> tuple[torch.Tensor, torch.Tensor, float]:
    """A small CAGrad dual on conflicting rows: ``(G, lin = G·1/K, r)``."""
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(6, 20, generator=gen, dtype=F64) + 2.0 * torch.randn(20, generator=gen,
                                                                          dtype=F64)
    gram = g @ g.T
    lin = gram.mean(dim=1)
    return gram, lin, 0.4 * float(lin.mean()) ** 0.5


@pytest.mark.parametrize("strict", [False, True])
def test_a_value_outside_the_bracket_raises_only_when_strict(strict: bool) -> None:
    """A monotone ``f`` (``1 − 1/ρ²``, its root at 1) whose third value is moved above the
    upper end's: raised with ``strict``, else the search goes on and returns its point."""
    gram, lin, r = _problem()
    w = torch.full((6,), 1 / 6, dtype=F64)
    calls: list[float] = []

    def f(rho: float) -> tuple[float, torch.Tensor]:
        calls.append(rho)
        value = 1.0 - 1.0 / (rho * rho)
        return (value + 10.0 if len(calls) == 3 else value), w

    if strict:
        with pytest.raises(InconsistentRoot, match="outside"):
            cagrad_root(gram, lin, r, 100.0, f, 1e-12, 200, strict=True)
        assert len(calls) == 3
    else:
        out = cagrad_root(gram, lin, r, 100.0, f, 1e-12, 200)
        assert out is w and len(calls) > 3


def test_a_monotone_f_never_raises() -> None:
    """A monotone ``f`` with values rounded at 1e-9 (below the margin): the strict search
    finds its root at 1 to ``tol`` (``f`` within ``tol`` of 0 or the bracket within it)."""
    gram, lin, r = _problem()
    w = torch.full((6,), 1 / 6, dtype=F64)
    last: list[float] = []

    def f(rho: float) -> tuple[float, torch.Tensor]:
        last.append(rho)
        noise = 1e-9 * (-1) ** len(last)
        return 1.0 - 1.0 / (rho * rho) + noise, w

    cagrad_root(gram, lin, r, 100.0, f, 1e-8, 200, strict=True)
    assert abs(last[-1] - 1.0) <= 1e-6
