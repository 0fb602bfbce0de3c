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
