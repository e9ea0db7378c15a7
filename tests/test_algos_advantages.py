"""Tests for offstep.algos.advantages: GRPO outcome advantage and GAE."""

import math

import pytest
import torch

from offstep.algos.advantages import gae_advantage, grpo_outcome_advantage
from offstep.algos.common import masked_whiten

F64 = torch.float64
GARBAGE = [float("nan"), float("inf"), -1e30, 123.0]


def pad(x, k, fill):
    """Append ``k`` columns of ``fill`` to the last dim of ``x``."""
    return torch.cat([x, torch.full((*x.shape[:-1], k), fill, dtype=x.dtype)], dim=-1)


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


def test_grpo_padding_invariance():
    # the only [B, R] input is the mask: extra padded columns must leave the valid part unchanged
    scores = torch.tensor([1.0, 0.0, 2.0, 1.0], dtype=F64)
    groups = torch.tensor([0, 0, 1, 1])
    mask = length_mask([3, 1, 2, 3], 3)
    adv, ret = grpo_outcome_advantage(scores, groups, mask)
    adv_p, ret_p = grpo_outcome_advantage(scores, groups, pad(mask, 4, 0.0))
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
    adv_p, ret_p = gae_advantage(
        pad(garbage_r, 3, fill), pad(garbage_v, 3, fill), pad(mask, 3, 0.0), 0.9, 0.8, whiten
    )
    torch.testing.assert_close(adv_p[:, :5], adv)
    torch.testing.assert_close(ret_p[:, :5], ret)
    assert (adv_p[:, 5:] == 0).all() and (ret_p[:, 5:] == 0).all()
