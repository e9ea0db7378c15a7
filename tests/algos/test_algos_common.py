"""Tests for offstep.algos.common: masked reductions and loss aggregation."""

import pytest
import torch
from conftest import GARBAGE, mini_batch_denom, pad

from offstep.algos.common import (
    AGG_MODES,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

F64 = torch.float64


# x = [[1, 2, 3], [4, 5, 6]] with valid entries 1, 2 | 4
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
M = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64)


def test_masked_sum_and_mean_hand():
    # valid: 1 + 2 + 4 = 7 over 3 tokens; per row: 1+2 = 3 (2 tokens), 4 (1 token)
    assert masked_sum(X, M).item() == 7.0
    assert masked_sum(X, M, dim=-1).tolist() == [3.0, 4.0]
    assert masked_mean(X, M).item() == pytest.approx(7 / 3)
    assert masked_mean(X, M, dim=-1).tolist() == [1.5, 4.0]
    # a row with no valid entries has mean 0, not nan
    assert masked_mean(X, torch.zeros_like(M), dim=-1).tolist() == [0.0, 0.0]


def test_masked_var_hand():
    # values 1, 2, 4: mean 7/3; squared deviations 16/9 + 1/9 + 25/9 = 42/9 = 14/3
    # unbiased 14/3 / 2 = 7/3; biased 14/3 / 3 = 14/9
    assert masked_var(X, M).item() == pytest.approx(7 / 3)
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(14 / 9)
    assert masked_var(X, M).item() == pytest.approx(torch.tensor([1.0, 2.0, 4.0]).var().item())
    # a single valid entry: variance 0 (not nan from n - 1 = 0)
    one = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    assert masked_var(X, one).item() == 0.0


def test_masked_whiten_hand():
    out = masked_whiten(X, M)
    valid = out[M.bool()]
    # (x - 7/3) / sqrt(7/3): mean 0, unbiased std 1 over the valid entries; padding 0
    expect = (torch.tensor([1.0, 2.0, 4.0], dtype=F64) - 7 / 3) / (7 / 3) ** 0.5
    torch.testing.assert_close(valid, expect)
    assert valid.mean().abs().item() < 1e-12 and valid.std().item() == pytest.approx(1.0)
    assert out[~M.bool()].tolist() == [0.0, 0.0, 0.0]
    # shift_mean=False keeps the mean 7/3
    unshifted = masked_whiten(X, M, shift_mean=False)[M.bool()]
    assert unshifted.mean().item() == pytest.approx(7 / 3)


def test_aggregate_loss_hand():
    # per-row sums 3 and 4, per-row lengths 2 and 1, 3 valid tokens, 2 sequences, width 3
    cases = {
        "token-mean": 7 / 3,  # (1 + 2 + 4) / 3
        "token-sum": 7.0,  # 1 + 2 + 4, no normaliser
        "seq-mean-token-sum": 3.5,  # (3 + 4) / 2
        "seq-mean-token-mean": 2.75,  # (3/2 + 4/1) / 2
        "seq-mean-token-sum-norm": 7 / 6,  # (3/3 + 4/3) / 2, horizon = width 3
    }
    for mode, expect in cases.items():
        assert aggregate_loss(X, M, mode).item() == pytest.approx(expect), mode
    # explicit denominators: token-mean 7 / 14; seq modes (3 + 4) / 4; horizon 10: 0.7 / 2
    assert aggregate_loss(X, M, "token-mean", denom=14).item() == pytest.approx(0.5)
    assert aggregate_loss(X, M, "token-sum", denom=0.5).item() == pytest.approx(14.0)  # 2 ranks: 7 / (1/2)
    assert aggregate_loss(X, M, "seq-mean-token-sum", denom=4).item() == pytest.approx(1.75)
    assert aggregate_loss(X, M, "seq-mean-token-sum-norm", horizon=10).item() == pytest.approx(0.35)


def test_aggregate_loss_is_weights_hand():
    # weights 2, 0.5 | 3 on the valid entries (garbage under the padding): weighted losses 2, 1 | 12,
    # per-row sums 3 and 12, per-row lengths 2 and 1, 3 valid tokens, 2 sequences, width 3
    w = torch.tensor([[2.0, 0.5, float("nan")], [3.0, float("inf"), -1e30]], dtype=F64, requires_grad=True)
    cases = {
        "token-mean": (5.0, 3.0),  # (2 + 1 + 12) / 3; d/dx = w / 3
        "seq-mean-token-sum": (7.5, 2.0),  # (3 + 12) / 2; d/dx = w / 2
        "seq-mean-token-mean": (6.75, None),  # (3/2 + 12/1) / 2; d/dx = w / (2 n_i)
        "seq-mean-token-sum-norm": (2.5, 6.0),  # (3/3 + 12/3) / 2, horizon = width 3; d/dx = w / 6
    }
    for mode, (expect, scale) in cases.items():
        x = X.clone().requires_grad_()
        loss = aggregate_loss(x, M, mode, is_weights=w)
        assert loss.item() == pytest.approx(expect), mode
        loss.backward()
        grad = (
            [[2.0 / 4, 0.5 / 4, 0.0], [3.0 / 2, 0.0, 0.0]]
            if scale is None
            else [[2.0 / scale, 0.5 / scale, 0.0], [3.0 / scale, 0.0, 0.0]]
        )
        torch.testing.assert_close(x.grad, torch.tensor(grad, dtype=F64))
    assert w.grad is None  # the weights are constants
    # with denom and horizon: token-mean 15 / 10; seq-mean-token-sum-norm (3/10 + 12/10) / 5
    assert aggregate_loss(X, M, "token-mean", denom=10, is_weights=w).item() == pytest.approx(1.5)
    assert aggregate_loss(X, M, "seq-mean-token-sum-norm", denom=5, horizon=10, is_weights=w).item() == pytest.approx(
        0.3
    )
    # weights of 1 change nothing
    for mode in AGG_MODES:
        assert aggregate_loss(X, M, mode, is_weights=torch.ones_like(X)).item() == aggregate_loss(X, M, mode).item()


def test_aggregate_loss_ignores_empty_rows_and_rejects_bad_mode():
    # a third all-padding row must not count as a sequence: same results as above
    x = torch.cat([X, torch.full((1, 3), 9.0, dtype=F64)])
    m = torch.cat([M, torch.zeros(1, 3, dtype=F64)])
    for mode in AGG_MODES:
        assert aggregate_loss(x, m, mode).item() == pytest.approx(aggregate_loss(X, M, mode).item())
    assert aggregate_loss(X, torch.zeros_like(M)).item() == 0.0
    with pytest.raises(ValueError):
        aggregate_loss(X, M, "sum")


@pytest.mark.parametrize("fill", GARBAGE)
def test_padding_invariance(fill):
    xp, mp = pad(X, 4, fill), pad(M, 4, 0.0)
    torch.testing.assert_close(masked_sum(xp, mp), masked_sum(X, M))
    torch.testing.assert_close(masked_sum(xp, mp, dim=-1), masked_sum(X, M, dim=-1))
    torch.testing.assert_close(masked_mean(xp, mp), masked_mean(X, M))
    torch.testing.assert_close(masked_mean(xp, mp, dim=-1), masked_mean(X, M, dim=-1))
    torch.testing.assert_close(masked_var(xp, mp), masked_var(X, M))
    torch.testing.assert_close(masked_whiten(xp, mp)[:, :3], masked_whiten(X, M))
    assert (masked_whiten(xp, mp)[:, 3:] == 0).all()
    for mode in AGG_MODES:
        torch.testing.assert_close(aggregate_loss(xp, mp, mode, horizon=3), aggregate_loss(X, M, mode, horizon=3))


def test_padding_invariance_of_gradients():
    x = pad(X, 2, float("nan")).requires_grad_()
    aggregate_loss(x, pad(M, 2, 0.0), "seq-mean-token-mean").backward()
    # row 0: d/dx of (x0 + x1) / 2 / 2 = 0.25; row 1: x / 1 / 2 = 0.5; padding and masked: 0
    expect = [[0.25, 0.25, 0, 0, 0], [0.5, 0, 0, 0, 0]]
    assert x.grad.tolist() == expect


def random_batch(b=8, r=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 6, 3, 2, 5, 6, 4, 1])[:b]
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    return torch.randn(b, r, generator=g), mask


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("n_micro", [1, 2, 4])
def test_micro_batch_invariance(mode, n_micro):
    x, mask = random_batch()
    x_full = x.clone().requires_grad_()
    aggregate_loss(x_full, mask, mode).backward()

    denom = mini_batch_denom(mask, mode)
    x_acc = x.clone().requires_grad_()
    total = 0.0
    for xs, ms in zip(x_acc.chunk(n_micro), mask.chunk(n_micro)):
        loss = aggregate_loss(xs, ms, mode, denom=denom)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(aggregate_loss(x, mask, mode).item(), abs=1e-6)
    torch.testing.assert_close(x_acc.grad, x_full.grad, atol=1e-6, rtol=0)
