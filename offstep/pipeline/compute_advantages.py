"""From a scored batch to advantages and returns, in the driver between the reference/critic
forward passes and the updates: reward shaping (DAPO's overlong penalty, the KL penalty in the
reward), then the estimator chosen by ``algorithm.adv_estimator``. The maths lives in
``offstep.algos`` (pure functions); this module only picks and feeds them."""

from __future__ import annotations

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
from offstep.algos.common import masked_mean
from offstep.algos.dapo import overlong_penalty
from offstep.algos.distill import distill_advantages, distill_metrics
from offstep.algos.kl_control import (
    FixedKLController,
    kl_controller,
    kl_penalized_rewards,
)
from offstep.batch import TrainBatch
from offstep.config.choices import ADV_ESTIMATORS
from offstep.config.schema import AlgorithmConfig, Config, DistillConfig
from offstep.telemetry.names import Adv, Distill, Reward


def needs_old_logprobs(cfg: Config, batch_size: int, actor_frozen: bool = False) -> bool:
    """Whether the actor must compute the pre-update log-probs in a pass of their own: the PPO
    ratio needs them for every mini-batch after the first, and the KL penalty in the reward
    before the advantages; otherwise the actor takes them from its own forward pass (one epoch,
    one mini-batch), and in bypass mode the rollout's log-probs are the old policy. The M2PO mask
    (``algorithm.m2po_threshold``) needs them first too: it is chosen over a whole mini-batch."""
    algo = cfg.algorithm
    if algo.correction_mode == "bypass":
        return False
    one_pass = cfg.actor.ppo_epochs == 1 and cfg.actor.mini_batch_size in (0, batch_size)
    m2po = algo.correction_mode == "decoupled" and algo.m2po_threshold > 0
    return algo.use_kl_in_reward or (not actor_frozen and (m2po or not one_pass))


def build_kl_controller(algo: AlgorithmConfig) -> FixedKLController:
    """The coefficient of the KL penalty in the reward (``algorithm.kl_ctrl``)."""
    c = algo.kl_ctrl
    return kl_controller(c.type, c.kl_coef, c.target_kl, c.horizon)


def compute_advantages(
    batch: TrainBatch,
    algo: AlgorithmConfig,
    kl_ctrl: FixedKLController | None = None,
    max_response_length: int | None = None,
    distill: DistillConfig | None = None,
) -> dict[str, float]:
    """Set ``batch.advantages`` and ``batch.returns``; return metrics.

    Needs ``batch.values`` for GAE, ``batch.baseline_scores`` for ReMax, ``batch.ref_logprobs``
    and ``batch.old_logprobs`` for the KL penalty in the reward (``kl_ctrl`` gives its
    coefficient and is updated with the measured KL), and ``max_response_length`` for the
    overlong penalty. ``batch.scores`` are left as the task rewards. With a distillation teacher
    (``distill``; ``batch.teacher_logprobs``), loss_mode=k1 adds ``coef x (teacher - student)`` per
    token to the task advantage, or replaces it (``use_task_rewards=false``); the student's
    log-probs are the trainer's old ones where computed, else the rollout's.
    """
    mask = batch.response_mask
    m: dict[str, float] = {}
    scores = batch.scores
    baseline = batch.baseline_scores
    if algo.overlong_penalty:
        if max_response_length is None:
            raise ValueError("the overlong penalty needs max_response_length (rollout.max_new_tokens)")
        pen = overlong_penalty(
            mask.sum(-1), max_response_length, algo.overlong_buffer_len, algo.overlong_penalty_factor
        )
        scores = scores + pen
        m[Reward.OVERLONG_PENALTY] = float(pen.mean())
        if baseline is not None and batch.baseline_lengths is not None:
            baseline = baseline + overlong_penalty(
                batch.baseline_lengths, max_response_length, algo.overlong_buffer_len, algo.overlong_penalty_factor
            )
    token_rewards = outcome_token_rewards(scores, mask)
    seq_scores = scores.to(token_rewards.dtype)
    if algo.use_kl_in_reward:
        if batch.ref_logprobs is None or batch.old_logprobs is None:
            raise ValueError("algorithm.use_kl_in_reward needs the batch's ref_logprobs and old_logprobs")
        kl_ctrl = kl_ctrl or build_kl_controller(algo)
        beta = kl_ctrl.value
        penalised, kl = kl_penalized_rewards(
            token_rewards, batch.old_logprobs, batch.ref_logprobs, mask, beta, algo.kl_penalty
        )
        seq_scores = seq_scores + (penalised - token_rewards).sum(-1)  # score - beta * sum_t kl_t
        token_rewards = penalised
        kl_ctrl.update(float(kl), n_steps=len(batch))
        m.update({Reward.KL_PENALTY: float(kl), Reward.KL_COEF: beta})

    est = algo.adv_estimator
    if est == "grpo":
        adv, ret = grpo_outcome_advantage(
            seq_scores, batch.group_ids, mask, norm_by_std=algo.norm_adv_by_std, alone=algo.one_response_groups
        )
    elif est == "rloo":
        adv, ret = rloo_advantage(seq_scores, batch.group_ids, mask, alone=algo.one_response_groups)
    elif est == "opo":
        adv, ret = opo_advantage(seq_scores, batch.group_ids, mask, alone=algo.one_response_groups)
    elif est == "gpg":
        adv, ret = gpg_advantage(seq_scores, batch.group_ids, mask)
    elif est == "grpo_passk":
        adv, ret = grpo_passk_advantage(seq_scores, batch.group_ids, mask, norm_by_std=algo.norm_adv_by_std)
    elif est == "reinforce_plus_plus_baseline":
        adv, ret = reinforce_pp_baseline_advantage(seq_scores, batch.group_ids, mask)
    elif est == "reinforce_plus_plus":
        adv, ret = reinforce_pp_advantage(token_rewards, mask, gamma=algo.gamma)
    elif est == "remax":
        if baseline is None:
            raise ValueError("adv_estimator=remax needs the greedy baseline's scores (SamplingParams.greedy_baseline)")
        adv, ret = remax_advantage(token_rewards, baseline, mask)
        m[Reward.GREEDY_BASELINE] = float(baseline.mean())
    elif est == "gae":
        adv, ret = gae_advantage(token_rewards, batch.values, mask, gamma=algo.gamma, lam=algo.lam)
    else:
        raise ValueError(f"unknown algorithm.adv_estimator={est!r}; expected one of {ADV_ESTIMATORS}")
    if distill is not None and distill.enabled:
        m.update(_distill(batch, adv, distill))
        adv = batch.advantages
    else:
        batch.advantages = adv
    batch.returns = ret
    valid = mask.bool()
    if valid.any():
        m.update(
            {
                Adv.MEAN: float(masked_mean(adv, valid)),
                Adv.ABS_MEAN: float(masked_mean(adv.abs(), valid)),
                Adv.MAX: float(adv[valid].max()),
                Adv.MIN: float(adv[valid].min()),
            }
        )
    return m


def _distill(batch: TrainBatch, task, d: DistillConfig) -> dict[str, float]:
    """Set ``batch.advantages`` from the task's ``task`` and the teacher's signal; its metrics."""
    if batch.teacher_logprobs is None:
        raise ValueError("distill.teacher is set but the batch has no teacher log-probs (a sample came back unscored)")
    student = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
    mask = batch.response_mask
    if d.loss_mode == "k1":
        batch.advantages = distill_advantages(
            task if d.use_task_rewards else None, student, batch.teacher_logprobs, mask, d.coef, d.log_prob_min_clamp
        )
    else:  # forward_kl_topk: the teacher's signal is a loss term of the actor's (offstep.train.actor)
        batch.advantages = task if d.use_task_rewards else task.new_zeros(task.shape)
    kl, teacher = distill_metrics(student, batch.teacher_logprobs, mask)
    return {Distill.REVERSE_KL: kl, Distill.TEACHER_LOGPROB: teacher}
