"""DB-MTL gradient part: the first step by hand, the EMA recursion, the log-loss option."""

from __future__ import annotations

import pytest
import torch

from gradbalance.balancers import DBMTL

G1 = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, -1.0]], dtype=torch.float64)
G2 = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 1.0], [2.0, 0.0, 0.0]], dtype=torch.float64)


def test_first_step_scales_every_task_to_the_largest_norm() -> None:
    # ĝ = (1 - β) g; norms 5, 0.5, 1 (times 0.1): every row rescaled to norm 5·0.1.
    out = DBMTL(beta=0.9)(G1)
    expected = 0.1 * (G1[0] + 10 * G1[1] + 5 * G1[2])
    torch.testing.assert_close(out, expected)


def test_second_step_uses_the_decayed_ema() -> None:
    beta, sigma = 0.8, 0.5
    b = DBMTL(beta=beta, beta_sigma=sigma)
    b(G1)
    ema = (1 - beta) * G1
    b2 = beta / 2**sigma
    ema = b2 * ema + (1 - b2) * G2
    norms = ema.norm(dim=1)
    expected = ((norms.max() / norms).unsqueeze(1) * ema).sum(0)
    torch.testing.assert_close(b(G2), expected)


def test_log_losses_divides_rows_by_the_losses() -> None:
    losses = torch.tensor([2.0, 0.25, 4.0], dtype=torch.float64)
    with_log = DBMTL(log_losses=True)(G1, losses)
    scaled = DBMTL(eps=0.0)(G1 / (losses + 1e-8).unsqueeze(1))
    torch.testing.assert_close(with_log, scaled)
    with pytest.raises(ValueError, match="must be positive"):
        DBMTL(log_losses=True)(G1, torch.tensor([1.0, -2.0, 1.0], dtype=torch.float64))


def test_invalid_beta() -> None:
    with pytest.raises(ValueError, match=r"Invalid beta: 1\.0"):
        DBMTL(beta=1.0)


@pytest.mark.parametrize("entries", [1, 7, 64, 2**19])
@pytest.mark.parametrize("log_losses", [False, True])
def test_row_blocks_give_the_ema_and_update_of_the_formula(entries: int,
                                                           log_losses: bool) -> None:
    """Three steps with the element-wise passes in blocks of ``entries`` (one row each at 1,
    one block at 2**19) against the EMA and the rescaling written out in float64, rows of
    norms 1e-3 … 1e3 and a zero row."""
    from gradbalance.balancers import _row_blocks

    gen = torch.Generator().manual_seed(entries)
    steps = [torch.randn(9, 13, generator=gen) * torch.logspace(-3, 3, 9)[:, None]
             for _ in range(3)]
    for g in steps:
        g[4] = 0.0
    losses = [torch.rand(9, generator=gen) + 0.5 for _ in steps]
    balancer = DBMTL(beta=0.8, beta_sigma=0.5, log_losses=log_losses)
    ema = torch.zeros(9, 13, dtype=torch.float64)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_row_blocks, "ROW_BLOCK_ENTRIES", entries)
        for t, (g, loss) in enumerate(zip(steps, losses, strict=True), start=1):
            out = balancer.combine(g, loss if log_losses else None).vector
            rows = g.double() / (loss.double() + 1e-8)[:, None] if log_losses else g.double()
            beta_t = 0.8 / t**0.5
            ema = beta_t * ema + (1 - beta_t) * rows
            norms = ema.norm(dim=1)
            scale = torch.where(norms > 0, norms.max() / torch.where(norms > 0, norms, 1.0), 0.0)
            expected = (scale[:, None] * ema).sum(dim=0)
            torch.testing.assert_close(out.double(), expected, rtol=1e-5,
                                       atol=1e-6 * float(expected.abs().max()))
