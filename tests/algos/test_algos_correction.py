"""Tests for offstep.algos.correction: truncated importance weights, rejection masks, mismatch KL
terms and per-staleness statistics for the rollout/trainer mismatch."""

import math

import pytest
import torch
from conftest import GARBAGE, pad

from offstep.algos.common import aggregate_loss
from offstep.algos.correction import (
    GroupedTokenStats,
    mismatch_kl_terms,
    rejection_mask,
    truncated_flags,
    truncated_importance_weights,
)
from offstep.algos.losses import clipped_policy_loss

F64 = torch.float64


def test_token_level_hand():
    # old - rollout = log 0.5, log 1.5, log 3 -> raw weights 0.5, 1.5, 3 -> capped 0.5, 1.5, 2
    # mean (0.5 + 1.5 + 2) / 3 = 4/3; max 2; truncated 1 of 3
    # k1 = mean(rollout - old) = -log(0.5 * 1.5 * 3) / 3 = -log(2.25) / 3 = -0.27031
    # k3 = mean(r - log r - 1) = (0.19315 + 0.09453 + 0.90139) / 3 = 0.39636
    rollout = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64)
    old = rollout + torch.tensor([[0.5, 1.5, 3.0]], dtype=F64).log()
    w, m = truncated_importance_weights(old, rollout, torch.ones(1, 3, dtype=F64), cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0]], dtype=F64))
    assert m["is_weight_mean"].item() == pytest.approx(4 / 3)
    assert m["is_weight_max"].item() == pytest.approx(2.0)
    assert m["is_truncated_frac"].item() == pytest.approx(1 / 3)
    assert m["mismatch_kl_k1"].item() == pytest.approx(-math.log(2.25) / 3)
    k3 = sum(r - math.log(r) - 1 for r in (0.5, 1.5, 3.0)) / 3
    assert m["mismatch_kl_k3"].item() == pytest.approx(k3)
    assert k3 == pytest.approx(0.39636, abs=1e-5)


def test_sequence_level_hand():
    # seq 0: ratios 2 * 0.75 = 1.5 over its 2 valid tokens (3rd is padding) -> w = 1.5
    # seq 1: ratios 2 * 2 * 1 = 4 -> capped at 2
    # mean over the 5 valid tokens, as verl's rollout_is_mean: (1.5 * 2 + 2 * 3) / 5 = 1.8 (the mean
    # over sequences would be 1.75); per-sequence max 2, truncated 1 of 2
    ratios = torch.tensor([[2.0, 0.75, 1000.0], [2.0, 2.0, 1.0]], dtype=F64)
    rollout = torch.full((2, 3), -1.0, dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    w, m = truncated_importance_weights(rollout + ratios.log(), rollout, mask, level="sequence")
    torch.testing.assert_close(w, torch.tensor([[1.5, 1.5, 0.0], [2.0, 2.0, 2.0]], dtype=F64))
    assert m["is_weight_mean"].item() == pytest.approx(1.8)
    assert m["is_weight_max"].item() == pytest.approx(2.0)
    assert m["is_truncated_frac"].item() == pytest.approx(0.5)


def test_no_cap_overflow_detached_and_bad_level():
    rollout = torch.zeros(2, 2, dtype=F64)
    old = torch.tensor([[math.log(5.0), 0.0], [400.0, 400.0]], dtype=F64, requires_grad=True)
    mask = torch.ones(2, 2, dtype=F64)
    w, m = truncated_importance_weights(old, rollout, mask, cap=None)
    assert not w.requires_grad and all(not v.requires_grad for v in m.values())
    assert w[0].tolist() == pytest.approx([5.0, 1.0])  # no truncation
    assert torch.isfinite(w).all() and m["is_truncated_frac"].item() == 0.0
    # a sequence log-ratio of 800 must not overflow: capped
    w, _ = truncated_importance_weights(old, rollout, mask, cap=3.0, level="sequence")
    assert w[1].tolist() == [3.0, 3.0]
    with pytest.raises(ValueError):
        truncated_importance_weights(old, rollout, mask, level="geometric")


@pytest.mark.parametrize("fill", GARBAGE)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_padding_invariance(fill, level):
    g = torch.Generator().manual_seed(0)
    rollout = torch.randn(3, 4, generator=g, dtype=F64) - 1
    old = rollout + torch.randn(3, 4, generator=g, dtype=F64) * 0.5
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=F64)
    w, m = truncated_importance_weights(old, rollout, mask, cap=1.5, level=level)

    def spoil(x):  # garbage under the existing padding, plus 3 padded columns of garbage
        return pad(torch.where(mask.bool(), x, torch.full_like(x, fill)), 3, fill)

    w_p, m_p = truncated_importance_weights(spoil(old), spoil(rollout), pad(mask, 3, 0.0), cap=1.5, level=level)
    torch.testing.assert_close(w_p[:, :4], w)
    assert (w_p[:, 4:] == 0).all() and (w[~mask.bool()] == 0).all()
    torch.testing.assert_close(m_p, m)


def test_weights_plug_into_policy_loss():
    # identical rollout and trainer log-probs -> all weights 1 -> loss unchanged
    g = torch.Generator().manual_seed(1)
    logp, old, adv = (torch.randn(2, 5, generator=g) for _ in range(3))
    mask = torch.tensor([[1.0, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    w, m = truncated_importance_weights(old, old.clone(), mask)
    assert m["mismatch_kl_k1"].item() == 0.0 and m["mismatch_kl_k3"].item() == 0.0
    torch.testing.assert_close(w, mask)
    per_token = clipped_policy_loss(logp, old, adv, mask)[0]
    torch.testing.assert_close(aggregate_loss(per_token, mask, is_weights=w), aggregate_loss(per_token, mask))


# ---------------------------------------------------------------- rejection, flags, per-staleness stats

# ratios pi_old / pi_rollout: row 0: 3, 1, 0.4; row 1: 1.5, 1.5, (padding)
REJ_RATIOS = torch.tensor([[3.0, 1.0, 0.4], [1.5, 1.5, 1.0]], dtype=F64)
REJ_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=F64)
REJ_ROLLOUT = torch.full((2, 3), -1.0, dtype=F64)
REJ_OLD = REJ_ROLLOUT + REJ_RATIOS.log()


@pytest.mark.parametrize(
    "kwargs, keep, frac",
    [
        # token, [0.5, 2]: 3 and 0.4 are rejected -> 2 of 5 valid tokens
        ({"level": "token"}, [[0, 1, 0], [1, 1, 0]], 2 / 5),
        # token, [0.3, 2]: only 3 is rejected
        ({"level": "token", "ratio_low": 0.3}, [[0, 1, 1], [1, 1, 0]], 1 / 5),
        # sequence: products 3 * 1 * 0.4 = 1.2 (kept) and 1.5 * 1.5 = 2.25 > 2 (rejected)
        ({"level": "sequence"}, [[1, 1, 1], [0, 0, 0]], 2 / 5),
        # geometric: 1.2^(1/3) = 1.063 and 1.5, both inside [0.5, 2]
        ({"level": "geometric"}, [[1, 1, 1], [1, 1, 0]], 0.0),
        # KL: mean k3 = r - ln r - 1 per response: row 0 (0.9014 + 0 + 0.3163) / 3 = 0.4059 > 0.2,
        #     row 1 0.0945 <= 0.2 -> row 0 rejected
        ({"level": "off", "kl_threshold": 0.2}, [[0, 0, 0], [1, 1, 0]], 3 / 5),
        ({"level": "off", "kl_threshold": 0.41}, [[1, 1, 1], [1, 1, 0]], 0.0),
    ],
)
def test_rejection_mask_hand(kwargs, keep, frac):
    k, m = rejection_mask(REJ_OLD, REJ_ROLLOUT, REJ_MASK, **kwargs)
    torch.testing.assert_close(k, torch.tensor(keep, dtype=F64))
    assert m["rejected_frac"].item() == pytest.approx(frac)
    with pytest.raises(ValueError):
        rejection_mask(REJ_OLD, REJ_ROLLOUT, REJ_MASK, level="median")


@pytest.mark.parametrize("fill", GARBAGE)
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_rejection_padding_invariance(fill, level):
    def spoil(x):
        return pad(torch.where(REJ_MASK.bool(), x, torch.full_like(x, fill)), 2, fill)

    k, m = rejection_mask(REJ_OLD, REJ_ROLLOUT, REJ_MASK, level=level, kl_threshold=0.3)
    k_p, m_p = rejection_mask(spoil(REJ_OLD), spoil(REJ_ROLLOUT), pad(REJ_MASK, 2, 0.0), level=level, kl_threshold=0.3)
    torch.testing.assert_close(k_p[:, :3], k)
    assert (k_p[:, 3:] == 0).all()
    torch.testing.assert_close(m_p, m)


def test_mismatch_terms_and_truncated_flags():
    # d = old - rollout = ln 3, 0, ln 0.4: k1 = -d; k3 = e^d - d - 1 = 0.9014, 0, 0.3163
    k1, k3 = mismatch_kl_terms(REJ_OLD, REJ_ROLLOUT, REJ_MASK)
    torch.testing.assert_close(k1[0], -torch.tensor([math.log(3), 0.0, math.log(0.4)], dtype=F64))
    assert k3[0].tolist() == pytest.approx([3 - math.log(3) - 1, 0.0, 0.4 - math.log(0.4) - 1])
    assert k1[1, 2] == 0 and k3[1, 2] == 0
    # token flags with cap 2: only the 3 is truncated; sequence: 1.2 no, 2.25 yes (both its tokens)
    torch.testing.assert_close(
        truncated_flags(REJ_OLD, REJ_ROLLOUT, REJ_MASK, 2.0), torch.tensor([[1.0, 0, 0], [0, 0, 0]], dtype=F64)
    )
    torch.testing.assert_close(
        truncated_flags(REJ_OLD, REJ_ROLLOUT, REJ_MASK, 2.0, "sequence"),
        torch.tensor([[0.0, 0, 0], [1, 1, 0]], dtype=F64),
    )
    # they agree with the truncation fraction of truncated_importance_weights
    _, m = truncated_importance_weights(REJ_OLD, REJ_ROLLOUT, REJ_MASK, cap=2.0)
    assert m["is_truncated_frac"].item() == pytest.approx(1 / 5)
    assert truncated_flags(REJ_OLD, REJ_ROLLOUT, REJ_MASK, None).sum() == 0


def test_grouped_token_stats_hand():
    # batch 1: rows with staleness 0 and 1; x = [1, 2, pad], [3, pad, pad]
    # batch 2: one row with staleness 1; x = [5, 7, 9]; level 2 never appears
    # level 0: mean (1 + 2) / 2 = 1.5, max 2; level 1: (3 + 5 + 7 + 9) / 4 = 6, max 9; level 2: 0
    s = GroupedTokenStats([0, 1, 2], max_of={"x": "x_max"})
    s.add(
        {"x": torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])},
        torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
        torch.tensor([0, 1]),
    )
    s.add({"x": torch.tensor([[5.0, 7.0, 9.0]])}, torch.ones(1, 3), torch.tensor([1]))
    sums, maxes = s.totals()
    assert sums == [3.0, 24.0, 0.0, 2.0, 4.0, 0.0] and maxes == [2.0, 9.0, 0.0]
    assert s.metrics(sums, maxes) == {
        "x/staleness_0": 1.5,
        "x/staleness_1": 6.0,
        "x/staleness_2": 0.0,
        "x_max/staleness_0": 2.0,
        "x_max/staleness_1": 9.0,
        "x_max/staleness_2": 0.0,
    }
    # two ranks: element-wise sums of (sums, counts) give the pooled means
    doubled = [2 * v for v in sums]
    assert s.metrics(doubled, maxes)["x/staleness_1"] == 6.0
