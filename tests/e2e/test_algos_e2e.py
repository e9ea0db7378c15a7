"""Every algorithm option through the whole pipeline: short tiny-preset runs (2 steps, k = 1).

A custom reward that varies with the response (its length mod 3) gives non-zero advantages even
to the random tiny model, so each estimator and loss really acts on the weights. The first cases
run by default; the rest are marked slow (each run is a few seconds of Ray start-up and steps).
"""

from __future__ import annotations

import math

import pytest

from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl

pytestmark = pytest.mark.ray  # every test here starts Ray

REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
    "    return (len(solution_str) % 3) / 2.0\n"
)


def run(tmp_path, *extra):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    cfg = load_config(
        [
            "preset=tiny",
            "pipeline.max_staleness=1",
            "trainer.total_steps=2",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.progress=off",
            "trainer.val_before_train=false",
            "data.task_val_size=4",
            f"reward.custom_path={reward}",
            "rollout.n=4",
            *extra,
        ]
    )
    train(cfg)
    return [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if m["step"] >= 1]


def finite(m: dict, key: str) -> bool:
    return key in m and math.isfinite(m[key])


FAST = [
    pytest.param(
        [
            "algorithm.adv_estimator=remax",
            "algorithm.policy_loss=gspo",
            "algorithm.correction_mode=bypass",
            "algorithm.clip_ratio_low=3e-4",
            "algorithm.clip_ratio_high=4e-4",
            "algorithm.loss_agg_mode=seq-mean-token-mean",
            "actor.ppo_epochs=2",
            "actor.mini_batch_size=8",
            "actor.micro_batch_size=4",
        ],
        [
            "reward/greedy_baseline",
            "actor/clipfrac",
            "actor/mismatch_kl_k1/staleness_1",
            "actor/mismatch_kl_k3/staleness_0",
        ],
        ["timing_s/old_logprobs", "actor/is_weight_mean"],  # bypass: no old-log-prob pass, no IS weights
        id="remax-gspo-bypass",
    ),
    pytest.param(
        [
            "algorithm.adv_estimator=reinforce_plus_plus",
            "algorithm.use_kl_in_reward=true",
            "algorithm.use_kl_loss=false",
            "algorithm.kl_ctrl.type=adaptive",
            "algorithm.kl_ctrl.kl_coef=0.05",
            "algorithm.kl_ctrl.target_kl=1e-6",
            "algorithm.kl_ctrl.horizon=16",
            "algorithm.clip_ratio_c=3.0",
            "algorithm.tis_level=sequence",
            "algorithm.rejection_level=geometric",
            "algorithm.rejection_kl=0.5",
        ],
        [
            "reward/kl_coef",
            "reward/kl_penalty",
            "timing_s/old_logprobs",
            "actor/dual_clipfrac",
            "actor/rejected_frac",
            "actor/is_weight_mean",
            "actor/is_weight_max/staleness_1",
            "actor/rejected_frac/staleness_1",
            "actor/is_truncated_frac/staleness_0",
        ],
        [],
        id="reinforce++-kl-in-reward-adaptive-dualclip-rejection",
    ),
]

SLOW = [
    pytest.param(
        [
            "algorithm.adv_estimator=rloo",
            "algorithm.policy_loss=cispo",
            "algorithm.clip_ratio_high=0.28",
            "algorithm.loss_agg_mode=seq-mean-token-sum",
        ],
        ["actor/clipfrac", "adv/abs_mean"],
        [],
        id="rloo-cispo",
    ),
    pytest.param(
        [
            "algorithm.adv_estimator=reinforce_plus_plus_baseline",
            "algorithm.policy_loss=pg",
            "algorithm.correction_mode=off",
        ],
        ["actor/mismatch_kl_k1", "adv/abs_mean"],
        ["actor/is_weight_mean"],
        id="reinforce++-baseline-pg-off",
    ),
    pytest.param(
        [
            "algorithm.adv_estimator=grpo",
            "algorithm.norm_adv_by_std=false",
            "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
            "algorithm.entropy_coeff=0.0",
        ],
        ["adv/abs_mean", "actor/pg_loss"],
        [],
        id="dr-grpo",
    ),
    pytest.param(
        [
            "algorithm.overlong_penalty=true",
            "algorithm.overlong_buffer_len=4",
            "algorithm.overlong_penalty_factor=0.5",
            "algorithm.tis_level=sequence",
            "algorithm.rejection_level=token",
            "actor.ppo_epochs=2",
            "actor.mini_batch_size=8",
        ],
        # two PPO epochs over two mini-batches: old log-probs come from a separate forward pass
        [
            "reward/overlong_penalty",
            "actor/rejected_frac",
            "actor/is_truncated_frac",
            "timing_s/old_logprobs",
            "actor/clipfrac",
        ],
        [],
        id="overlong-sequence-tis-token-rejection",
    ),
    pytest.param(
        ["algorithm.m2po_threshold=0.04", "algorithm.m2po_tokens=trust_region", "algorithm.rejection_level=token"],
        # one mini-batch, one epoch, yet a separate old-log-prob pass: M2PO masks the whole mini-batch
        [
            "actor/m2po_masked_frac",
            "actor/m2po_m2",
            "actor/m2po_m2_kept",
            "actor/m2po_masked_frac/staleness_1",
            "timing_s/old_logprobs",
        ],
        [],
        id="m2po-trust-region-token-rejection",
    ),
    pytest.param(
        [
            "algorithm.use_kl_in_reward=true",
            "algorithm.kl_penalty=low_var_kl",
            "algorithm.kl_ctrl.kl_coef=0.01",
            "pipeline.ref_on_rollout=true",
        ],
        ["reward/kl_coef", "reward/kl_penalty", "actor/kl"],
        [],
        id="grpo-kl-in-reward-fixed-ref-on-rollout",
    ),
]


def check(metrics, present, absent):
    assert [m["step"] for m in metrics] == [1, 2]
    assert [m["rollout/staleness_max"] for m in metrics] == [0, 1]
    for m in metrics:
        assert finite(m, "actor/grad_norm") and m["actor/grad_norm"] > 0
        assert finite(m, "actor/entropy") and finite(m, "actor/pg_loss")
    for key in present:
        assert any(finite(m, key) for m in metrics), key
    for key in absent:
        assert all(key not in m for m in metrics), key


@pytest.mark.parametrize("extra, present, absent", FAST)
def test_algorithm_options_run(tmp_path, ray_session, extra, present, absent):
    metrics = run(tmp_path, *extra)
    check(metrics, present, absent)
    assert any(m["adv/abs_mean"] > 0 for m in metrics)  # the reward varies, so the estimator acts
    if "algorithm.kl_ctrl.type=adaptive" in extra:
        # the coefficient used at step 2 follows from step 1's KL (0 there: the policy is still the
        # reference): beta2 = beta1 * (1 + clip(kl1 / target - 1, -0.2, 0.2) * 16 samples / horizon 16)
        c1, c2, kl1 = metrics[0]["reward/kl_coef"], metrics[1]["reward/kl_coef"], metrics[0]["reward/kl_penalty"]
        assert c1 == pytest.approx(0.05)
        assert c2 == pytest.approx(c1 * (1 + min(max(kl1 / 1e-6 - 1, -0.2), 0.2) * 16 / 16))


@pytest.mark.slow
@pytest.mark.parametrize("extra, present, absent", SLOW)
def test_more_algorithm_options_run(tmp_path, ray_session, extra, present, absent):
    check(run(tmp_path, *extra), present, absent)


def test_critic_warmup_freezes_the_actor(tmp_path, ray_session):
    metrics = run(tmp_path, "algorithm.adv_estimator=gae", "critic.warmup_steps=1", "trainer.total_steps=3")
    assert [m["actor/frozen"] for m in metrics] == [1.0, 0.0, 0.0]
    assert "actor/pg_loss" not in metrics[0] and "timing_s/update_actor" not in metrics[0]
    # PPO with GAE: the critic role joins the trainer pool
    assert all("critic/vf_loss" in m and "timing_s/values" in m and "timing_s/update_critic" in m for m in metrics)
    assert metrics[1]["actor/grad_norm"] > 0
