"""Tests for offstep.algos.advantages: GRPO, RLOO, OPO, GPG, GRPO pass@k, REINFORCE++ (and its
group-baseline variant), ReMax, GAE, and outcome rewards placed on the last token."""

import math

import pytest
import torch
from conftest import GARBAGE, pad

from offstep.algos.advantages import (
    gae_advantage,
    gpg_advantage,
    grpo_outcome_advantage,
    grpo_passk_advantage,
    opo_advantage,
    outcome_token_rewards,
    reinforce_pp_advantage,
    reinforce_pp_baseline_advantage,
    remax_advantage,
    rloo_advantage,
)
from offstep.algos.common import masked_whiten

F64 = torch.float64


def length_mask(lengths, r):
    return (torch.arange(r)[None, :] < torch.tensor(lengths)[:, None]).to(F64)


# ---------------------------------------------------------------- GRPO


def test_grpo_hand():
    # group 0: scores 1, 0 -> mean 0.5, std sqrt((0.25 + 0.25) / 1) = 0.7071
    #          -> advantages (1 - 0.5) / 0.7071 = +0.7071 and -0.7071
    # group 1: scores 1, 1 -> mean 1, std 0 -> advantages 0
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64)
    groups = torch.tensor([0, 0, 1, 1])
    mask = length_mask([3, 1, 2, 3], 3)
    adv, ret = grpo_outcome_advantage(scores, groups, mask)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    expect = torch.tensor([[a, a, a], [-a, 0, 0], [0, 0, 0], [0, 0, 0]], dtype=F64)
    torch.testing.assert_close(adv, expect)
    torch.testing.assert_close(ret, adv)
    assert adv[0, 0].item() == pytest.approx(0.70711, abs=1e-5)


def test_grpo_no_std_singleton_and_unsorted_ids():
    # groups 7: scores 3, 1 (mean 2) and 3: scores 0, 4, 2 (mean 2), 9: a single score 5
    scores = torch.tensor([3.0, 0.0, 1.0, 4.0, 5.0, 2.0], dtype=F64)
    groups = torch.tensor([7, 3, 7, 3, 9, 3])
    mask = torch.ones(6, 2, dtype=F64)
    adv, _ = grpo_outcome_advantage(scores, groups, mask, norm_by_std=False)
    # centred scores 1, -2, -1, 2, (singleton -> 0), 0
    assert adv[:, 0].tolist() == [1.0, -2.0, -1.0, 2.0, 0.0, 0.0]
    adv, _ = grpo_outcome_advantage(scores, groups, mask)
    # group 3 std = sqrt((4 + 4 + 0) / 2) = 2; group 7 std = sqrt((1 + 1) / 1) = 1.4142
    s2 = math.sqrt(2)
    expect = [1 / (s2 + 1e-6), -2 / (2 + 1e-6), -1 / (s2 + 1e-6), 2 / (2 + 1e-6), 0.0, 0.0]
    assert adv[:, 1].tolist() == pytest.approx(expect)


def grpo_reference(scores, groups, mask, norm_by_std, eps):
    """Plain loop: one group at a time with torch.mean / torch.std."""
    adv = torch.zeros(len(scores), dtype=F64)
    for g in set(groups.tolist()):
        idx = [i for i in range(len(scores)) if groups[i].item() == g]
        s = scores[idx]
        if len(idx) == 1:
            continue
        centred = s - s.mean()
        adv[idx] = centred / (s.std() + eps) if norm_by_std else centred
    return adv[:, None] * mask


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_loop_vs_vectorised(norm_by_std):
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(40, generator=g, dtype=F64)
    groups = torch.randint(0, 9, (40,), generator=g)
    mask = length_mask(torch.randint(1, 7, (40,), generator=g).tolist(), 6)
    adv, ret = grpo_outcome_advantage(scores, groups, mask, norm_by_std=norm_by_std)
    torch.testing.assert_close(adv, grpo_reference(scores, groups, mask, norm_by_std, 1e-6))
    torch.testing.assert_close(ret, adv)


@pytest.mark.parametrize("fn", [grpo_outcome_advantage, opo_advantage, gpg_advantage, grpo_passk_advantage])
def test_group_estimators_padding_invariance(fn):
    # the only [B, R] input is the mask: extra padded columns must leave the valid part unchanged
    scores = torch.tensor([1.0, 0.0, 2.0, 1.0], dtype=F64)
    groups = torch.tensor([0, 0, 1, 1])
    mask = length_mask([3, 1, 2, 3], 3)
    adv, ret = fn(scores, groups, mask)
    adv_p, ret_p = fn(scores, groups, pad(mask, 4, 0.0))
    torch.testing.assert_close(adv_p[:, :3], adv)
    torch.testing.assert_close(ret_p[:, :3], ret)
    assert (adv_p[:, 3:] == 0).all() and (ret_p[:, 3:] == 0).all()


# ---------------------------------------------------------------- GAE


def test_gae_hand_gamma_lam_one():
    # gamma = lam = 1: A_t = (sum of rewards from t) - V_t = 1 - V_t; returns = 1 everywhere
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    adv, ret = gae_advantage(rewards, values, mask, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.4, 0.3]], dtype=F64))
    torch.testing.assert_close(ret, torch.ones(1, 3, dtype=F64))


def test_gae_hand_discounted_with_padding():
    # gamma = lam = 0.5, response of 3 tokens then 2 padded columns (value after t=2 is 0):
    # t=2: delta = 1 + 0.5 * 0 - 0.7 = 0.3;                 A2 = 0.3
    # t=1: delta = 0 + 0.5 * 0.7 - 0.6 = -0.25;             A1 = -0.25 + 0.25 * 0.3 = -0.175
    # t=0: delta = 0 + 0.5 * 0.6 - 0.5 = -0.2;              A0 = -0.2 + 0.25 * -0.175 = -0.24375
    # returns = A + V = 0.25625, 0.425, 1.0
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0, 5.0]], dtype=F64)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0, 9.0]], dtype=F64)
    mask = length_mask([3], 5)
    adv, ret = gae_advantage(rewards, values, mask, gamma=0.5, lam=0.5, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[-0.24375, -0.175, 0.3, 0, 0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0.25625, 0.425, 1.0, 0, 0]], dtype=F64))


def gae_reference(rewards, values, mask, gamma, lam):
    """Plain per-sequence loop over the valid tokens only (value after the last one is 0)."""
    adv = torch.zeros_like(values)
    for b in range(values.shape[0]):
        idx = [t for t in range(values.shape[1]) if mask[b, t] > 0]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            next_adv = delta + gamma * lam * next_adv
            next_value = values[b, t].item()
            adv[b, t] = next_adv
    return adv, (adv + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
@pytest.mark.parametrize("holes", [False, True])
def test_gae_loop_vs_vectorised(gamma, lam, holes):
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(6, 8, generator=g, dtype=F64)
    values = torch.randn(6, 8, generator=g, dtype=F64)
    mask = length_mask([8, 1, 5, 3, 7, 2], 8)
    if holes:  # masked tokens inside a response (e.g. tool output) are skipped
        mask[0, 2:4] = 0
        mask[4, 1] = 0
    adv, ret = gae_advantage(rewards, values, mask, gamma=gamma, lam=lam, whiten=False)
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    adv_w, ret_w = gae_advantage(rewards, values, mask, gamma=gamma, lam=lam, whiten=True)
    torch.testing.assert_close(adv_w, masked_whiten(ref_adv, mask))
    torch.testing.assert_close(ret_w, ref_ret)  # returns use the un-whitened advantages


@pytest.mark.parametrize("fill", GARBAGE)
@pytest.mark.parametrize("whiten", [False, True])
def test_gae_padding_invariance(fill, whiten):
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(4, 5, generator=g, dtype=F64)
    values = torch.randn(4, 5, generator=g, dtype=F64)
    mask = length_mask([5, 2, 4, 1], 5)
    adv, ret = gae_advantage(rewards, values, mask, 0.9, 0.8, whiten=whiten)
    # garbage both under the existing padding and in 3 new padded columns
    garbage_r = torch.where(mask.bool(), rewards, torch.full_like(rewards, fill))
    garbage_v = torch.where(mask.bool(), values, torch.full_like(values, fill))
    adv_p, ret_p = gae_advantage(pad(garbage_r, 3, fill), pad(garbage_v, 3, fill), pad(mask, 3, 0.0), 0.9, 0.8, whiten)
    torch.testing.assert_close(adv_p[:, :5], adv)
    torch.testing.assert_close(ret_p[:, :5], ret)
    assert (adv_p[:, 5:] == 0).all() and (ret_p[:, 5:] == 0).all()


# ---------------------------------------------------------------- RLOO


def test_rloo_hand():
    # group 0: scores 1, 0, 0 -> 1 - (0 + 0) / 2 = 1; 0 - (1 + 0) / 2 = -0.5 (twice)
    # group 1: scores 2, 4    -> 2 - 4 = -2; 4 - 2 = 2
    # group 2: a single score 5 -> no baseline: 0
    scores = torch.tensor([1.0, 2.0, 0.0, 4.0, 0.0, 5.0], dtype=F64)
    groups = torch.tensor([0, 1, 0, 1, 0, 2])
    mask = length_mask([2, 1, 3, 3, 1, 2], 3)
    adv, ret = rloo_advantage(scores, groups, mask)
    expect = torch.tensor([1.0, -2.0, -0.5, 2.0, -0.5, 0.0], dtype=F64)[:, None] * mask
    torch.testing.assert_close(adv, expect)
    torch.testing.assert_close(ret, adv)


def test_rloo_loop_vs_vectorised_and_padding():
    g = torch.Generator().manual_seed(5)
    scores = torch.randn(30, generator=g, dtype=F64)
    groups = torch.randint(0, 7, (30,), generator=g)
    mask = length_mask(torch.randint(1, 5, (30,), generator=g).tolist(), 4)
    ref = torch.zeros(30, dtype=F64)
    for i in range(30):  # plain leave-one-out loop
        others = [scores[j].item() for j in range(30) if j != i and groups[j] == groups[i]]
        ref[i] = scores[i] - sum(others) / len(others) if others else 0.0
    adv, _ = rloo_advantage(scores, groups, mask)
    torch.testing.assert_close(adv, ref[:, None] * mask)
    adv_p, _ = rloo_advantage(scores, groups, pad(mask, 3, 0.0))
    torch.testing.assert_close(adv_p[:, :4], adv)
    assert (adv_p[:, 4:] == 0).all()


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_pp_hand():
    # gamma 0.5. row 0 rewards 0, 0, 1 -> returns 0.25, 0.5, 1
    #            row 1 rewards 0, 2 (+ a padded 7) -> returns 1, 2
    # valid returns 0.25, 0.5, 1, 1, 2: mean 0.95; deviations -0.7, -0.45, 0.05, 0.05, 1.05
    # unbiased var = (0.49 + 0.2025 + 0.0025 + 0.0025 + 1.1025) / 4 = 0.45
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 7.0]], dtype=F64)
    mask = length_mask([3, 2], 3)
    adv, ret = reinforce_pp_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]], dtype=F64))
    sd = math.sqrt(0.45 + 1e-8)
    expect = torch.tensor([[-0.7, -0.45, 0.05], [0.05, 1.05, 0.0]], dtype=F64) / sd
    torch.testing.assert_close(adv, expect)


def test_reinforce_pp_skips_holes():
    # a masked token inside the response is skipped: returns 1 + 0.5 * 1 = 1.5, 0, 1
    rewards = torch.tensor([[1.0, 9.0, 1.0]], dtype=F64)
    mask = torch.tensor([[1.0, 0.0, 1.0]], dtype=F64)
    _, ret = reinforce_pp_advantage(rewards, mask, gamma=0.5)
    torch.testing.assert_close(ret, torch.tensor([[1.5, 0.0, 1.0]], dtype=F64))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_loop_vs_vectorised_and_padding(gamma):
    g = torch.Generator().manual_seed(6)
    rewards = torch.randn(5, 6, generator=g, dtype=F64)
    mask = length_mask([6, 1, 4, 3, 5], 6)
    ref = torch.zeros_like(rewards)
    for b in range(5):
        running = 0.0
        for t in reversed(range(6)):
            if mask[b, t] > 0:
                running = rewards[b, t].item() + gamma * running
                ref[b, t] = running
    adv, ret = reinforce_pp_advantage(rewards, mask, gamma)
    torch.testing.assert_close(ret, ref)
    torch.testing.assert_close(adv, masked_whiten(ref, mask))
    spoiled = pad(torch.where(mask.bool(), rewards, torch.full_like(rewards, float("nan"))), 2, 1e30)
    adv_p, ret_p = reinforce_pp_advantage(spoiled, pad(mask, 2, 0.0), gamma)
    torch.testing.assert_close(adv_p[:, :6], adv)
    torch.testing.assert_close(ret_p[:, :6], ret)


def test_reinforce_pp_baseline_hand():
    # groups 0: scores 1, 0 (mean 0.5) -> 0.5, -0.5; group 1: 3, 1 (mean 2) -> 1, -1
    # lengths 2, 1, 1, 2 -> token values 0.5, 0.5, -0.5, 1, -1, -1: mean -1/12
    scores = torch.tensor([1.0, 0.0, 3.0, 1.0], dtype=F64)
    groups = torch.tensor([0, 0, 1, 1])
    mask = length_mask([2, 1, 1, 2], 2)
    adv, _ = reinforce_pp_baseline_advantage(scores, groups, mask)
    vals = [0.5, 0.5, -0.5, 1.0, -1.0, -1.0]
    mean = sum(vals) / 6
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / 5 + 1e-8)
    expect = torch.tensor([[0.5, 0.5], [-0.5, mean], [1.0, mean], [-1.0, -1.0]], dtype=F64)
    expect = (expect - mean) / sd * mask
    torch.testing.assert_close(adv, expect)
    adv_p, _ = reinforce_pp_baseline_advantage(scores, groups, pad(mask, 2, 0.0))
    torch.testing.assert_close(adv_p[:, :2], adv)


# ---------------------------------------------------------------- ReMax and outcome rewards


def test_outcome_token_rewards():
    # score on the last valid token; a row without valid tokens gets nothing
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]], dtype=F64)
    out = outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0, 5.0], dtype=F64), mask)
    expect = torch.tensor([[0, 2.0, 0], [0, 0, 3.0], [0, 0, 0], [0, 0, 5.0]], dtype=F64)
    torch.testing.assert_close(out, expect)


def test_remax_hand():
    # outcome rewards 1 and 0 on the last tokens; greedy baselines 0.5 and 0.5
    # row 0 (2 tokens): returns 1, 1 -> advantages 0.5, 0.5
    # row 1 (3 tokens): returns 0, 0, 0 -> advantages -0.5 x 3
    mask = length_mask([2, 3], 3)
    rewards = outcome_token_rewards(torch.tensor([1.0, 0.0], dtype=F64), mask)
    adv, ret = remax_advantage(rewards, torch.tensor([0.5, 0.5], dtype=F64), mask)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [-0.5, -0.5, -0.5]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64))
    # with a per-token KL penalty in the reward: rewards -0.1, 0.9 -> returns 0.8, 0.9 -> adv 0.3, 0.4
    adv, _ = remax_advantage(
        torch.tensor([[-0.1, 0.9]], dtype=F64), torch.tensor([0.5], dtype=F64), torch.ones(1, 2, dtype=F64)
    )
    torch.testing.assert_close(adv, torch.tensor([[0.3, 0.4]], dtype=F64))
    adv_p, _ = remax_advantage(pad(rewards, 2, 7.0), torch.tensor([0.5, 0.5], dtype=F64), pad(mask, 2, 0.0))
    assert (adv_p[:, 3:] == 0).all()


# ---------------------------------------------------------------- OPO, GPG, GRPO pass@k


def test_opo_hand():
    # group 0: lengths 2, 3, scores 1, 0 -> baseline (2 * 1 + 3 * 0) / 5 = 0.4 -> 0.6, -0.4
    # group 1: lengths 1, 3, scores 0.25, 0.5 -> baseline (0.25 + 1.5) / 4 = 0.4375 -> -0.1875, 0.0625
    # group 2: a single response -> 0 (verl: its score)
    scores = torch.tensor([1.0, 0.0, 0.25, 0.5, 7.0], dtype=F64)
    groups = torch.tensor([0, 0, 1, 1, 2])
    mask = length_mask([2, 3, 1, 3, 2], 3)
    adv, ret = opo_advantage(scores, groups, mask)
    assert adv[:, 0].tolist() == pytest.approx([0.6, -0.4, -0.1875, 0.0625, 0.0])
    torch.testing.assert_close(adv, adv[:, :1] * mask)  # the same value on every valid token, 0 on padding
    torch.testing.assert_close(ret, adv)
    # equal lengths: OPO's baseline is the plain group mean (GRPO without the std)
    even = length_mask([3, 3, 3, 3, 3], 3)
    torch.testing.assert_close(
        opo_advantage(scores, groups, even)[0], grpo_outcome_advantage(scores, groups, even, norm_by_std=False)[0]
    )


def test_gpg_hand():
    # B = 6 responses, M = 4 with a non-zero score -> alpha = 6 / 4 = 1.5
    # group 0: scores 1, 0, 1 (mean 2/3) -> 1.5 * (1/3, -2/3, 1/3) = 0.5, -1, 0.5
    # group 1: scores 0, 0.5 (mean 0.25) -> 1.5 * (-0.25, 0.25) = -0.375, 0.375
    # group 2: a single response (score 2) -> 0
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 2.0], dtype=F64)
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    mask = length_mask([1, 2, 3, 3, 1, 2], 3)
    adv, ret = gpg_advantage(scores, groups, mask)
    assert adv[:, 0].tolist() == pytest.approx([0.5, -1.0, 0.5, -0.375, 0.375, 0.0])
    torch.testing.assert_close(adv, adv[:, :1] * mask)
    # every score zero: alpha = 6 / max(1, 0), advantages 0 (no division by zero)
    assert gpg_advantage(torch.zeros(6, dtype=F64), groups, mask)[0].abs().sum().item() == 0.0


def test_grpo_passk_hand():
    # group 0: scores 0, 1, 0.5 -> best 1 (index 1), second 0.5: gap 0.5; std of (0, 1, 0.5) =
    #          sqrt((0.25 + 0.25 + 0) / 2) = 0.5 -> 0.5 / (0.5 + 1e-6); the others 0
    # group 1: scores 1, 1 -> a tie for the best: gap 0 for both
    # group 2: a single response -> 0
    scores = torch.tensor([0.0, 1.0, 0.5, 1.0, 1.0, 3.0], dtype=F64)
    groups = torch.tensor([0, 0, 0, 1, 1, 2])
    mask = length_mask([2, 2, 2, 2, 2, 2], 2)
    adv, ret = grpo_passk_advantage(scores, groups, mask)
    assert adv[:, 0].tolist() == pytest.approx([0.0, 0.5 / (0.5 + 1e-6), 0.0, 0.0, 0.0, 0.0])
    adv, _ = grpo_passk_advantage(scores, groups, mask, norm_by_std=False)
    assert adv[:, 1].tolist() == [0.0, 0.5, 0.0, 0.0, 0.0, 0.0]
    # the best is found wherever it sits in the batch, and only it is credited
    adv, _ = grpo_passk_advantage(
        torch.tensor([0.2, 0.9, 0.2], dtype=F64),
        torch.tensor([4, 5, 4]),
        torch.ones(3, 1, dtype=F64),
        norm_by_std=False,
    )
    assert adv[:, 0].tolist() == [0.0, 0.0, 0.0]  # groups {0.2, 0.2} (tie) and {0.9} (single)


def test_reinforce_pp_baseline_single_response_group_keeps_its_score():
    # groups {1, 0} and {5}: centred scores 0.5, -0.5; the single response keeps its raw 5 (baseline
    # 0, as verl), on lengths 2, 1, 1 -> tokens 0.5, 0.5 | -0.5 | 5: mean 5.5 / 4 = 1.375;
    # deviations -0.875, -0.875, -1.875, 3.625; unbiased var
    # (0.765625 * 2 + 3.515625 + 13.140625) / 3 = 18.1875 / 3 = 6.0625, sigma 2.462214
    # -> the single response ends at 3.625 / 2.462214 = 1.47225
    scores = torch.tensor([1.0, 0.0, 5.0], dtype=F64)
    groups = torch.tensor([0, 0, 1])
    mask = length_mask([2, 1, 1], 2)
    adv, _ = reinforce_pp_baseline_advantage(scores, groups, mask)
    sigma = math.sqrt(18.1875 / 3 + 1e-8)
    assert adv[2, 0].item() == pytest.approx(3.625 / sigma) and adv[2, 0].item() == pytest.approx(1.47225, abs=1e-5)
    assert adv[0, 0].item() == pytest.approx(-0.875 / sigma)


def test_reinforce_pp_baseline_matches_verl_on_a_one_response_group():
    # the case of issue 27, checked against verl: groups [a, a, b], scores [1, 0, 1], one token each.
    # Group a: mean 0.5 -> 0.5, -0.5; group b (one response): its raw score 1.
    # Values 0.5, -0.5, 1: mean 1 / 3; deviations 1/6, -5/6, 2/3; unbiased var
    # (1/36 + 25/36 + 16/36) / 2 = 7/12, sigma 0.763763
    # -> 0.166667 / 0.763763 = 0.2182, -0.833333 / 0.763763 = -1.0911, 0.666667 / 0.763763 = 0.8729
    scores = torch.tensor([1.0, 0.0, 1.0], dtype=F64)
    adv, ret = reinforce_pp_baseline_advantage(scores, torch.tensor([0, 0, 1]), torch.ones(3, 1, dtype=F64))
    assert adv[:, 0].tolist() == pytest.approx([0.2182, -1.0911, 0.8729], abs=1e-4)
    sigma = math.sqrt(7 / 12 + 1e-8)
    assert adv[:, 0].tolist() == pytest.approx([(1 / 6) / sigma, (-5 / 6) / sigma, (2 / 3) / sigma])
    assert torch.equal(adv, ret)
