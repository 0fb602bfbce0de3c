"""Clipping at the edges of the number range and on sparse gradients.

Expected values are closed forms (a row ``g`` clipped to ``c`` is ``c·g/‖g‖``; AGC's unit is
``λ·‖W‖·G/‖G‖``) or the same clipper on a dense copy of the gradient."""

from __future__ import annotations

import pytest
import torch

from gradbalance.clip import AGC, AutoClip, TaskAutoClip, TaskClip

F16 = torch.float16


@pytest.mark.parametrize("make", [lambda: TaskClip(max_norm=1e-3),
                                  lambda: TaskAutoClip(percentile=0)], ids=["task", "auto"])
def test_a_16_bit_row_clipped_far_below_its_norm_keeps_its_direction(make) -> None:
    # factor 2e-8: cast to float16 first it was 0, and the row became zero
    clip = make()
    if isinstance(clip, TaskAutoClip):
        clip(torch.tensor([[6e-4, 8e-4]], dtype=F16))  # the history: norm 1e-3
    rows = torch.tensor([[3e4, 4e4]], dtype=F16)
    clip(rows)
    limit = 1e-3 if isinstance(clip, TaskClip) else float(torch.tensor([6e-4, 8e-4],
                                                                       dtype=F16).float().norm())
    expected = torch.tensor([[0.6, 0.8]]) * limit
    torch.testing.assert_close(rows.float(), expected, rtol=2e-3, atol=0.0)


def test_auto_clip_of_16_bit_gradients_far_above_the_threshold() -> None:
    p = torch.nn.Parameter(torch.zeros(2, dtype=F16))
    clip = AutoClip(percentile=0)
    p.grad = torch.tensor([6e-4, 8e-4], dtype=F16)
    clip([p])
    threshold = float(clip.threshold)
    p.grad = torch.tensor([3e4, 4e4], dtype=F16)
    clip([p])
    torch.testing.assert_close(p.grad.float(), torch.tensor([0.6, 0.8]) * threshold,
                               rtol=2e-3, atol=0.0)


def test_agc_of_a_16_bit_gradient_far_above_its_limit() -> None:
    w = torch.nn.Parameter(torch.tensor([[0.54, 0.0]], dtype=F16))
    w.grad = torch.tensor([[6e4, 0.0]], dtype=F16)
    AGC(clip_factor=0.01)([w])
    expected = 0.01 * float(w.detach().float().norm())  # λ‖W‖, the weight as stored
    torch.testing.assert_close(w.grad.float(), torch.tensor([[expected, 0.0]]), rtol=2e-3,
                               atol=0.0)


def test_agc_on_a_weight_whose_squares_overflow_float32() -> None:
    w = torch.nn.Parameter(torch.tensor([[3e19, 4e19]]))  # ‖W‖ = 5e19, finite in float32
    w.grad = torch.tensor([[3e18, 4e18]])  # ratio 0.1 > λ = 0.01
    AGC(clip_factor=0.01)([w])
    torch.testing.assert_close(w.grad, torch.tensor([[3e17, 4e17]]), rtol=1e-6, atol=0.0)


def _sparse_grad() -> torch.nn.Embedding:
    emb = torch.nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 2, 2, 7])).pow(2).sum().mul(50).backward()
    return emb


def test_auto_clip_on_a_sparse_gradient_is_the_dense_copys() -> None:
    torch.manual_seed(0)
    emb = _sparse_grad()
    dense = torch.nn.Parameter(emb.weight.detach().clone())
    dense.grad = emb.weight.grad.to_dense()
    totals: dict[str, list[torch.Tensor]] = {}
    clips = {"sparse": AutoClip(percentile=0), "dense": AutoClip(percentile=0)}
    for name, p in (("sparse", emb.weight), ("dense", dense)):
        p.grad.mul_(0.01)  # the history: a first, smaller norm
        first = clips[name]([p])
        p.grad.mul_(100.0)  # then 100 times that norm: clipped to the first
        totals[name] = [first, clips[name]([p])]
    torch.testing.assert_close(totals["sparse"], totals["dense"])
    assert emb.weight.grad.layout == torch.sparse_coo
    torch.testing.assert_close(emb.weight.grad.to_dense(), dense.grad, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dense.grad.norm(), totals["dense"][0], rtol=1e-5, atol=0.0)


def test_agc_refuses_a_sparse_gradient_by_name_before_anything_moves() -> None:
    emb = _sparse_grad()
    before = emb.weight.grad.to_dense().clone()
    with pytest.raises(ValueError, match=r"parameters\[0\] \(shape \(10, 3\)\) has a sparse "
                                         r"\.grad.*exclude="):
        AGC()([emb.weight])
    assert torch.equal(emb.weight.grad.to_dense(), before)
    AGC(exclude=[emb.weight])([emb.weight])  # excluded: nothing to clip, no refusal


def test_a_history_of_integers_is_refused_naming_its_dtype() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    clip = AutoClip(history_size=3)
    clip([p])
    state = clip.state_dict()
    state["history"] = state["history"].long()
    with pytest.raises(ValueError, match=r"got a tensor of dtype torch\.int64"):
        AutoClip(history_size=3).load_state_dict(state)
