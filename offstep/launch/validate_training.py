"""The checks of the training side of the config (``algorithm``, ``actor.optim``,
``critic.optim``; ``training.py``): each choice valid, and no combination that cannot work. Part
of ``validate.problems``."""

from __future__ import annotations

import math

from offstep.config.choices import (
    ADV_ESTIMATORS,
    CORRECTION_MODES,
    DISTILL_LOSS_MODES,
    DTYPE_NAMES,
    GROUP_ESTIMATORS,
    KL_CONTROLLERS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    LR_SCHEDULES,
    M2PO_TOKENS,
    ONE_RESPONSE_GROUPS,
    POLICY_LOSSES,
    REJECTION_LEVELS,
    REWARD_PLACEMENTS,
    ROLLOUT_ENGINES,
    SCORE_ALONE_ESTIMATORS,
    TIS_LEVELS,
)
from offstep.config.schema import Config, OptimConfig
from offstep.launch.checks import choice, need


def check_algorithm(cfg: Config, e: list[str]) -> None:
    """The algorithm keys (docs/algorithms.md): each choice valid, and no combination that cannot work."""
    a, r = cfg.algorithm, cfg.rollout
    choice(a.adv_estimator, "algorithm.adv_estimator", ADV_ESTIMATORS, e)
    choice(a.policy_loss, "algorithm.policy_loss", POLICY_LOSSES, e)
    choice(a.kl_estimator, "algorithm.kl_estimator", KL_ESTIMATORS, e)
    choice(a.kl_penalty, "algorithm.kl_penalty", KL_ESTIMATORS, e)
    choice(a.kl_ctrl.type, "algorithm.kl_ctrl.type", KL_CONTROLLERS, e)
    choice(a.loss_agg_mode, "algorithm.loss_agg_mode", LOSS_AGG_MODES, e)
    choice(a.correction_mode, "algorithm.correction_mode", CORRECTION_MODES, e)
    choice(a.tis_level, "algorithm.tis_level", TIS_LEVELS, e)
    choice(a.rejection_level, "algorithm.rejection_level", REJECTION_LEVELS, e)
    choice(a.m2po_tokens, "algorithm.m2po_tokens", M2PO_TOKENS, e)
    choice(a.one_response_groups, "algorithm.one_response_groups", ONE_RESPONSE_GROUPS, e)
    est = a.adv_estimator
    alone = a.one_response_groups == "score" and est in SCORE_ALONE_ESTIMATORS  # verl's: the advantage is the score
    need(
        not (est in GROUP_ESTIMATORS and r.n == 1 and not alone),  # n < 1 is refused on its own
        f"algorithm.adv_estimator={est} compares the rewards of the samples of one prompt with each other, so it "
        f"needs rollout.n >= 2 (got {r.n}); with rollout.n=1 every advantage would be 0. Set rollout.n=4, or use "
        f"algorithm.adv_estimator=reinforce_plus_plus, remax or gae (or, for grpo, rloo and opo, "
        f"algorithm.one_response_groups=score: verl's advantage, the score itself)",
        e,
    )
    need(
        not (est == "remax" and r.temperature == 0),
        "algorithm.adv_estimator=remax compares sampled responses with a greedy one, but rollout.temperature=0 "
        "samples greedily too (every advantage would be 0); set rollout.temperature > 0",
        e,
    )
    need(
        not (est in GROUP_ESTIMATORS and r.n >= 2 and r.temperature == 0),
        f"rollout.temperature=0 is greedy decoding, so the rollout.n={r.n} samples of a prompt are all the same "
        f"response, and algorithm.adv_estimator={est}, which compares them with each other, gives every advantage 0; "
        f"set rollout.temperature > 0 (e.g. 1.0), or use algorithm.adv_estimator=reinforce_plus_plus or gae",
        e,
    )
    need(
        a.clip_ratio_low >= 0 and a.clip_ratio_high >= 0,
        f"algorithm.clip_ratio_low/high = {a.clip_ratio_low}/{a.clip_ratio_high} must be >= 0",
        e,
    )
    if a.clip_ratio_c is not None:
        need(
            a.policy_loss == "ppo",
            f"algorithm.clip_ratio_c (dual-clip) bounds PPO's clipped loss; it has no meaning for "
            f"algorithm.policy_loss={a.policy_loss}: set algorithm.clip_ratio_c=null, or algorithm.policy_loss=ppo",
            e,
        )
        need(
            a.clip_ratio_c > 1,
            f"algorithm.clip_ratio_c={a.clip_ratio_c} must be > 1 (e.g. 3.0), or null to disable dual-clip",
            e,
        )
    need(
        a.loss_agg_horizon >= 0,
        f"algorithm.loss_agg_horizon={a.loss_agg_horizon} must be >= 0 (0: rollout.max_new_tokens)",
        e,
    )
    need(a.kl_coef >= 0 and a.kl_ctrl.kl_coef >= 0, "algorithm.kl_coef and algorithm.kl_ctrl.kl_coef must be >= 0", e)
    if a.use_kl_in_reward and a.kl_ctrl.type == "adaptive":
        need(
            a.kl_ctrl.target_kl > 0 and a.kl_ctrl.horizon > 0,
            f"algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl > 0 and algorithm.kl_ctrl.horizon > 0 "
            f"(got {a.kl_ctrl.target_kl}, {a.kl_ctrl.horizon})",
            e,
        )
    # Off-policy correction
    mode = a.correction_mode
    rejects = a.rejection_level != "off" or a.rejection_kl > 0
    need(
        not (rejects and mode != "decoupled"),
        f"algorithm.rejection_level / rejection_kl reject tokens by the ratio of the trainer's to the rollout's "
        f"log-probs, which only algorithm.correction_mode=decoupled computes (got {mode}); set correction_mode=decoupled "
        f"or rejection_level=off rejection_kl=0",
        e,
    )
    need(
        not (mode == "bypass" and (r.top_p < 1 or r.top_k > 0)),
        f"algorithm.correction_mode=bypass uses the rollout's log-probs as the old policy, but with rollout.top_p="
        f"{r.top_p} / rollout.top_k={r.top_k} they are those of the truncated sampling distribution, which the "
        f"trainer's policy does not have; use correction_mode=decoupled, or rollout.top_p=1 rollout.top_k=0",
        e,
    )
    need(a.tis_cap > 0, f"algorithm.tis_cap={a.tis_cap} must be > 0", e)
    need(
        a.rejection_ratio_high > 1 and 0 <= a.rejection_ratio_low < 1,
        f"algorithm.rejection_ratio_low/high = {a.rejection_ratio_low}/{a.rejection_ratio_high}: need high > 1 and "
        f"0 <= low < 1 (low 0: 1 / high)",
        e,
    )
    need(a.rejection_kl >= 0, f"algorithm.rejection_kl={a.rejection_kl} must be >= 0 (0: off)", e)
    need(
        a.m2po_threshold >= 0,
        f"algorithm.m2po_threshold={a.m2po_threshold} must be >= 0 (0: off; M2PO's paper uses 0.04)",
        e,
    )
    need(
        not (a.m2po_threshold > 0 and mode != "decoupled"),
        f"algorithm.m2po_threshold={a.m2po_threshold} masks tokens by the log-ratio of the trainer's to the rollout's "
        f"log-probs, which only algorithm.correction_mode=decoupled computes (got {mode}); set correction_mode=decoupled "
        f"or m2po_threshold=0",
        e,
    )
    # Critic
    w = cfg.critic.warmup_steps
    need(w >= 0, f"critic.warmup_steps={w} must be >= 0", e)
    need(
        not (w > 0 and est != "gae"),
        f"critic.warmup_steps={w} trains the critic alone first, but only algorithm.adv_estimator=gae has a critic "
        f"(got {est}); set critic.warmup_steps=0 or algorithm.adv_estimator=gae",
        e,
    )
    need(
        not (w > 0 and w >= cfg.trainer.total_steps),
        f"critic.warmup_steps={w} >= trainer.total_steps={cfg.trainer.total_steps}: the actor would never train",
        e,
    )
    # DAPO
    if a.overlong_penalty:
        need(
            0 < a.overlong_buffer_len <= r.max_new_tokens,
            f"algorithm.overlong_buffer_len={a.overlong_buffer_len} must be in [1, rollout.max_new_tokens="
            f"{r.max_new_tokens}] (responses longer than max_new_tokens - buffer are penalised)",
            e,
        )
    if a.dynamic_sampling:
        need(
            r.n >= 2,
            f"algorithm.dynamic_sampling drops groups whose rewards are all equal; with rollout.n={r.n} "
            f"every group has one response and would be dropped; set rollout.n >= 2",
            e,
        )
        need(
            a.dynamic_sampling_max_attempts >= 1,
            f"algorithm.dynamic_sampling_max_attempts={a.dynamic_sampling_max_attempts} must be >= 1",
            e,
        )


def check_optim(o: OptimConfig, key: str, e: list[str]) -> None:
    """AdamW's settings (torch.optim.AdamW refuses these only when the first step runs)."""
    # NaN fails every comparison: one message per key says "finite" (the loop over all floats in
    # validate() then skips the key).
    need(
        math.isfinite(o.lr) and o.lr >= 0,
        f"{key}.lr={o.lr} must be a finite number >= 0, e.g. 1e-6"
        + (" (a negative learning rate ascends the loss)" if o.lr < 0 else ""),
        e,
    )
    need(
        math.isfinite(o.weight_decay) and o.weight_decay >= 0,
        f"{key}.weight_decay={o.weight_decay} must be a finite number >= 0 (0: none)",
        e,
    )
    need(
        len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas),
        f"{key}.betas={list(o.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999]",
        e,
    )
    need(o.grad_clip > 0, f"{key}.grad_clip={o.grad_clip} must be a number > 0 (inf: no clipping)", e)
    need(o.warmup_steps >= 0, f"{key}.warmup_steps={o.warmup_steps} must be >= 0 (0: no warm-up)", e)
    need(
        o.lr_scheduler_type in LR_SCHEDULES,
        f"{key}.lr_scheduler_type={o.lr_scheduler_type!r} must be one of {list(LR_SCHEDULES)}",
        e,
    )
    need(
        math.isfinite(o.min_lr_ratio) and 0 <= o.min_lr_ratio <= 1,
        f"{key}.min_lr_ratio={o.min_lr_ratio} must be in [0, 1] (the cosine's end, as a fraction of lr)",
        e,
    )
    need(
        math.isfinite(o.num_cycles) and o.num_cycles > 0,
        f"{key}.num_cycles={o.num_cycles} must be > 0 (0.5: one monotone decay)",
        e,
    )


def check_distill(cfg: Config, e: list[str]) -> None:
    """``distill`` (docs/distillation.md); whether the teacher's folder holds a causal LM with the
    policy's vocabulary is the preflight's."""
    d, t, res = cfg.distill, cfg.distill.teacher, cfg.resources
    if not d.enabled:
        need(
            d.use_task_rewards,
            "distill.use_task_rewards=false trains on the teacher's signal alone, but no teacher is "
            "given: set distill.teacher.path to a model folder or alias, or drop distill.use_task_rewards",
            e,
        )
        return
    choice(t.placement, "distill.teacher.placement", REWARD_PLACEMENTS, e)
    choice(t.engine, "distill.teacher.engine", ROLLOUT_ENGINES, e)
    choice(t.dtype, "distill.teacher.dtype", DTYPE_NAMES, e)
    choice(d.loss_mode, "distill.loss_mode", DISTILL_LOSS_MODES, e)
    need(t.batch_size >= 1, f"distill.teacher.batch_size={t.batch_size} must be >= 1", e)
    need(t.timeout_s > 0, f"distill.teacher.timeout_s={t.timeout_s} must be > 0 seconds", e)
    need(
        d.loss_mode != "forward_kl_topk" or d.topk >= 1,
        f"distill.topk={d.topk} must be >= 1 with loss_mode=forward_kl_topk",
        e,
    )
    need(
        math.isfinite(d.coef) and d.coef > 0,
        f"distill.coef={d.coef} must be a finite number > 0 (no teacher: drop distill.teacher.path)",
        e,
    )
    need(
        math.isfinite(d.log_prob_min_clamp) and d.log_prob_min_clamp < 0,
        f"distill.log_prob_min_clamp={d.log_prob_min_clamp} must be a finite number below 0 (e.g. -10)",
        e,
    )
    for key, v, low in (
        ("teacher_workers", res.teacher_workers, 1),
        ("cpus_per_teacher_worker", res.cpus_per_teacher_worker, 1),
        ("gpus_per_teacher_worker", res.gpus_per_teacher_worker, 0),
    ):
        need(v >= low, f"resources.{key}={v} must be >= {low}", e)
    if t.engine == "vllm":
        need(
            d.loss_mode != "forward_kl_topk",
            "distill.teacher.engine=vllm gives the sampled tokens' log-probs only; "
            "distill.loss_mode=forward_kl_topk needs distill.teacher.engine=builtin",
            e,
        )
        need(
            cfg.rollout.temperature == 1.0,
            f"distill.teacher.engine=vllm scores untempered log-probs, and the student "
            f"samples at rollout.temperature={cfg.rollout.temperature}; set rollout.temperature=1.0 or "
            f"distill.teacher.engine=builtin (which scores at the rollout's temperature)",
            e,
        )
        need(
            not (t.placement == "rollout" and cfg.rollout.engine == "vllm"),
            "distill.teacher.engine=vllm with distill.teacher.placement=rollout and rollout.engine=vllm would put two "
            "vLLM engines in one replica's process; put the teacher in a pool of its own "
            "(distill.teacher.placement=pool) or set distill.teacher.engine=builtin",
            e,
        )
