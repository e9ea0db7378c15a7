"""Tests for offstep.pipeline.compute_advantages.compute_advantages: every estimator picked by config, the
reward shaping before it (overlong penalty, KL in the reward), and the errors for missing inputs."""

import pytest
import torch

from offstep.algos import advantages as estimators
from offstep.batch import Sample, collate
from offstep.config.schema import AlgorithmConfig, KLControlConfig
from offstep.pipeline.compute_advantages import (
    ADV_ESTIMATORS,
    build_kl_controller,
    compute_advantages,
)


def make_batch(scores=(1.0, 0.0, 0.5, 0.5), lengths=(2, 3, 1, 3), uids=(7, 7, 8, 8), baseline=None):
    samples = [
        Sample(
            uid=u,
            prompt_ids=[1, 2],
            response_ids=list(range(3, 3 + n)),
            rollout_logprobs=[-1.0] * n,
            finish_reason="stop",
            score=s,
            version=0,
            baseline_score=None if baseline is None else baseline[i],
            baseline_length=None if baseline is None else 3,
        )
        for i, (s, n, u) in enumerate(zip(scores, lengths, uids))
    ]
    return collate(samples, pad_id=0)


def test_default_is_grpo_unchanged():
    batch = make_batch()
    m = compute_advantages(batch, AlgorithmConfig())
    expect, _ = estimators.grpo_outcome_advantage(batch.scores, batch.group_ids, batch.response_mask)
    torch.testing.assert_close(batch.advantages, expect)
    # group 7: scores 1, 0 -> +-0.7071; group 8: equal -> 0; token values 0.7071 x 2, -0.7071 x 3, 0 x 4
    assert m["adv/max"] == pytest.approx(0.70711, abs=1e-5) and m["adv/mean"] == pytest.approx(-0.70711 / 9, abs=1e-5)


def outcome(b):
    """The score on the last token of each response: the token-level estimators' rewards."""
    return estimators.outcome_token_rewards(b.scores, b.response_mask)


# Each estimator computed directly by its own function, for the dispatch to match.
DIRECT = {
    "grpo": lambda b: estimators.grpo_outcome_advantage(b.scores, b.group_ids, b.response_mask),
    "rloo": lambda b: estimators.rloo_advantage(b.scores, b.group_ids, b.response_mask),
    "reinforce_plus_plus_baseline": lambda b: estimators.reinforce_pp_baseline_advantage(
        b.scores, b.group_ids, b.response_mask
    ),
    "opo": lambda b: estimators.opo_advantage(b.scores, b.group_ids, b.response_mask),
    "gpg": lambda b: estimators.gpg_advantage(b.scores, b.group_ids, b.response_mask),
    "grpo_passk": lambda b: estimators.grpo_passk_advantage(b.scores, b.group_ids, b.response_mask),
    "reinforce_plus_plus": lambda b: estimators.reinforce_pp_advantage(outcome(b), b.response_mask),
    "remax": lambda b: estimators.remax_advantage(outcome(b), b.baseline_scores, b.response_mask),
    "gae": lambda b: estimators.gae_advantage(outcome(b), b.values, b.response_mask),
}


def full_batch():
    """A batch every estimator can use: scores 1, 0, 0.25, 0.5 in groups 7, 7, 8, 8 (the group
    means differ, so centring per group matters), greedy baselines 0.5, 0.5, 0, 1, critic values."""
    batch = make_batch(scores=(1.0, 0.0, 0.25, 0.5), baseline=[0.5, 0.5, 0.0, 1.0])
    values = torch.tensor([[0.3, -0.2, 0.0], [0.1, 0.4, -0.5], [0.2, 0.0, 0.0], [-0.1, 0.6, 0.2]])
    batch.values = values * batch.response_mask
    return batch


def test_every_estimator_has_a_direct_result_that_differs():
    # the estimators give pairwise different advantages on this batch, so routing one to another's
    # function cannot pass test_dispatch_equals_the_estimators_function
    assert set(DIRECT) == set(ADV_ESTIMATORS)
    results = {est: fn(full_batch())[0] for est, fn in DIRECT.items()}
    for a in ADV_ESTIMATORS:
        for b in ADV_ESTIMATORS:
            assert a == b or not torch.allclose(results[a], results[b]), (a, b)


@pytest.mark.parametrize("est", ADV_ESTIMATORS)
def test_dispatch_equals_the_estimators_function(est):
    batch = full_batch()
    compute_advantages(batch, AlgorithmConfig(adv_estimator=est))
    assert batch.advantages.shape == batch.response_mask.shape
    adv, ret = DIRECT[est](full_batch())
    torch.testing.assert_close(batch.advantages, adv, rtol=0, atol=0)
    torch.testing.assert_close(batch.returns, ret, rtol=0, atol=0)
    assert (batch.advantages[batch.response_mask == 0] == 0).all()


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
    algo = AlgorithmConfig(
        adv_estimator="rloo",
        use_kl_in_reward=True,
        kl_penalty="k1",
        kl_ctrl=KLControlConfig(type="adaptive", kl_coef=0.5, target_kl=0.05, horizon=8),
    )
    ctrl = build_kl_controller(algo)
    m = compute_advantages(batch, algo, ctrl)
    assert batch.advantages[:, 0].tolist() == pytest.approx([1.05, -1.05, 0.1, -0.1])
    assert m["reward/kl_coef"] == 0.5 and m["reward/kl_penalty"] == pytest.approx(0.1)
    assert ctrl.value == pytest.approx(0.55)
    # REINFORCE++ sees the per-token penalty: row 1 (3 tokens, score 0) returns -0.15, -0.1, -0.05
    batch.advantages = None
    compute_advantages(
        batch,
        AlgorithmConfig(
            adv_estimator="reinforce_plus_plus", use_kl_in_reward=True, kl_ctrl=KLControlConfig(kl_coef=0.5)
        ),
    )
    assert batch.returns[1].tolist() == pytest.approx([-0.15, -0.1, -0.05])
    with pytest.raises(ValueError, match="use_kl_in_reward"):
        compute_advantages(make_batch(), algo)


def test_unknown_estimator():
    with pytest.raises(ValueError, match="adv_estimator"):
        compute_advantages(make_batch(), AlgorithmConfig(adv_estimator="ppo2"))
