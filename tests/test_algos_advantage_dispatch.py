"""Tests for offstep.pipeline.advantage.compute_advantages: every estimator picked by config, the
reward shaping before it (overlong penalty, KL in the reward), and the errors for missing inputs."""

import pytest
import torch

from offstep.algos.advantages import grpo_outcome_advantage, rloo_advantage
from offstep.batch import Sample, collate
from offstep.config.schema import AlgorithmConfig, KLControlConfig
from offstep.pipeline.advantage import (
    ADV_ESTIMATORS,
    build_kl_controller,
    compute_advantages,
)


def make_batch(scores=(1.0, 0.0, 0.5, 0.5), lengths=(2, 3, 1, 3), uids=(7, 7, 8, 8), baseline=None):
    samples = [
        Sample(uid=u, prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)), rollout_logprobs=[-1.0] * n,
               finish_reason="stop", score=s, version=0,
               baseline_score=None if baseline is None else baseline[i], baseline_length=None if baseline is None else 3)
        for i, (s, n, u) in enumerate(zip(scores, lengths, uids))
    ]
    return collate(samples, pad_id=0)


def test_default_is_grpo_unchanged():
    batch = make_batch()
    m = compute_advantages(batch, AlgorithmConfig())
    expect, _ = grpo_outcome_advantage(batch.scores, batch.group_ids, batch.response_mask)
    torch.testing.assert_close(batch.advantages, expect)
    # group 7: scores 1, 0 -> +-0.7071; group 8: equal -> 0; token values 0.7071 x 2, -0.7071 x 3, 0 x 4
    assert m["adv/max"] == pytest.approx(0.70711, abs=1e-5) and m["adv/mean"] == pytest.approx(-0.70711 / 9, abs=1e-5)


@pytest.mark.parametrize("est", [e for e in ADV_ESTIMATORS if e not in ("gae", "remax")])
def test_every_outcome_estimator_runs(est):
    batch = make_batch()
    compute_advantages(batch, AlgorithmConfig(adv_estimator=est))
    assert batch.advantages.shape == batch.response_mask.shape
    assert (batch.advantages[batch.response_mask == 0] == 0).all()
    if est == "rloo":
        torch.testing.assert_close(batch.advantages, rloo_advantage(batch.scores, batch.group_ids, batch.response_mask)[0])


def test_remax_and_gae():
    # ReMax: scores 1, 0, 0.5, 0.5 minus greedy baselines 0.5, 0.5, 0, 1 on every valid token
    batch = make_batch(baseline=[0.5, 0.5, 0.0, 1.0])
    m = compute_advantages(batch, AlgorithmConfig(adv_estimator="remax"))
    assert batch.advantages[:, 0].tolist() == [0.5, -0.5, 0.5, -0.5]
    assert m["reward/greedy_baseline"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="greedy"):
        compute_advantages(make_batch(), AlgorithmConfig(adv_estimator="remax"))
    # GAE, gamma = lam = 1, zero values, no whitening inside the check: returns = score on every token
    batch = make_batch()
    batch.values = torch.zeros_like(batch.response_mask)
    compute_advantages(batch, AlgorithmConfig(adv_estimator="gae"))
    torch.testing.assert_close(batch.returns, batch.scores[:, None] * batch.response_mask)


def test_overlong_penalty_before_advantages():
    # max 3 tokens, buffer 2: lengths 2, 3, 1, 3 -> penalties -0.5, -1, 0, -1 (factor 1)
    # shaped scores 0.5, -1, 0.5, -0.5 -> RLOO: group 7: 1.5, -1.5; group 8: 1, -1
    batch = make_batch()
    algo = AlgorithmConfig(adv_estimator="rloo", overlong_penalty=True, overlong_buffer_len=2)
    m = compute_advantages(batch, algo, max_response_length=3)
    assert batch.advantages[:, 0].tolist() == [1.5, -1.5, 1.0, -1.0]
    assert m["reward/overlong_penalty"] == pytest.approx(-2.5 / 4)
    assert batch.scores.tolist() == [1.0, 0.0, 0.5, 0.5]  # the task rewards are left as they were
    with pytest.raises(ValueError, match="max_response_length"):
        compute_advantages(make_batch(), algo)


def test_kl_in_reward_with_adaptive_controller():
    # k1 per token = old - ref = 0.1 everywhere; beta 0.5 -> each response loses 0.05 per token:
    # scores become 1 - 0.1, 0 - 0.15, 0.5 - 0.05, 0.5 - 0.15 -> RLOO group 7: 1.05, -1.05;
    # group 8: 0.1, -0.1. Batch KL 0.1 > target 0.05: beta x (1 + 0.2 * 4 / 8) = 0.55
    batch = make_batch()
    batch.old_logprobs = torch.full_like(batch.response_mask, -1.0)
    batch.ref_logprobs = torch.full_like(batch.response_mask, -1.1)
    algo = AlgorithmConfig(adv_estimator="rloo", use_kl_in_reward=True, kl_penalty="k1",
                           kl_ctrl=KLControlConfig(type="adaptive", kl_coef=0.5, target_kl=0.05, horizon=8))
    ctrl = build_kl_controller(algo)
    m = compute_advantages(batch, algo, ctrl)
    assert batch.advantages[:, 0].tolist() == pytest.approx([1.05, -1.05, 0.1, -0.1])
    assert m["reward/kl_coef"] == 0.5 and m["reward/kl_penalty"] == pytest.approx(0.1)
    assert ctrl.value == pytest.approx(0.55)
    # REINFORCE++ sees the per-token penalty: row 1 (3 tokens, score 0) returns -0.15, -0.1, -0.05
    batch.advantages = None
    compute_advantages(batch, AlgorithmConfig(adv_estimator="reinforce_plus_plus", use_kl_in_reward=True,
                                              kl_ctrl=KLControlConfig(kl_coef=0.5)))
    assert batch.returns[1].tolist() == pytest.approx([-0.15, -0.1, -0.05])
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        compute_advantages(make_batch(), algo)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="adv_estimator"):
        compute_advantages(make_batch(), AlgorithmConfig(adv_estimator="ppo2"))
