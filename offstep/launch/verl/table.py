"""verl's command-line keys in offstep: the one table. Each verl key is, in ``TABLE`` (exact keys)
or ``PREFIXES`` (groups of keys), one of:

* ``To(key)``: translated to an offstep key, its value converted where the conventions differ
  (``offstep.launch.verl.convert``);
* ``Derived(targets)``: translated from several keys, or with the composed config (verl counts
  ``ppo_mini_batch_size`` in prompts, offstep ``actor.mini_batch_size`` in sequences, so it needs
  ``rollout.n``): the derivations of ``offstep.launch.verl.derive`` run on the typed config after
  composition, and set the keys ``DERIVED_TARGETS`` lists;
* ``Note(why)``: accepted, with a one-line note (engine or memory tuning that does not apply);
* ``Refuse(why)``: refused with a message naming the key and what offstep does instead;
  ``allow`` lists the values that change nothing (the default: accepted with a note).

A key with a verl-only first part (``VERL_ONLY_ROOTS``) that the table does not know is refused.
``scripts/verl_keys_table.py`` renders the table into docs/from-verl.md (a test keeps them equal).
"""

from __future__ import annotations

from offstep.launch.verl.convert import (
    estimator,
    files,
    function_name,
    kl_type,
    loggers,
    never,
    never_validate,
    val_max_samples,
    zero_if_null,
)
from offstep.launch.verl.entries import (
    ENGINE,
    FSDP,
    MEGATRON,
    PROFILE,
    ULYSSES,
    Derived,
    Note,
    Refuse,
    To,
    schedule_name,
)
from offstep.launch.verl.table_roles import ROLE_KEYS

# First parts of verl's keys that offstep's schema does not have: such a key is verl's, and one the
# table does not know is refused. (data, algorithm, trainer, critic, rollout are shared.)
VERL_ONLY_ROOTS = (
    "actor_rollout_ref",
    "reward_model",
    "reward_manager",
    "custom_reward_function",
    "distillation",
    "global_profiler",
    "ray_kwargs",
    "transfer_queue",
    "async_training",
)


# ------------------------------------------------------------------ the table: the roles' keys (table_roles.py), then the rest
TABLE: dict[str, To | Derived | Note | Refuse] = {
    **ROLE_KEYS,
    # data
    "data.train_files": To("data.train_files", files),
    "data.val_files": To("data.val_files", files),
    "data.train_batch_size": To("data.train_batch_size"),
    "data.max_prompt_length": To("data.max_prompt_length"),
    "data.max_response_length": To("rollout.max_new_tokens"),
    "data.prompt_key": To("data.prompt_key"),
    "data.shuffle": To("data.shuffle"),
    "data.val_max_samples": To("data.val_max_samples", val_max_samples),
    "data.filter_overlong_prompts": Derived(
        "data.overlong_prompts", "true: filter; false: data.truncation (error, left, right or middle)"
    ),
    "data.truncation": Derived(
        "data.overlong_prompts",
        "with filter_overlong_prompts=false: error, left, right or middle (verl cuts the prompt's tokens: left keeps the last, right the first, middle both ends)",
    ),
    "data.train_max_samples": Refuse(
        "offstep trains on every row of data.train_files; cut the file instead", allow=(-1, None)
    ),
    "data.reward_fn_key": Refuse("offstep picks the scorer by each row's data_source", allow=("data_source",)),
    "data.filter_overlong_prompts_workers": Note("offstep filters in the driver"),
    "data.return_raw_chat": Note("offstep keeps the chat messages and applies the template itself"),
    "data.return_raw_input_ids": Note("offstep keeps the chat messages and applies the template itself"),
    "data.return_full_prompt": Note("offstep keeps the chat messages and applies the template itself"),
    "data.dataloader_num_workers": Note("offstep reads the prompts in the driver"),
    "data.val_batch_size": Note("offstep validates in batches of rollout.max_batch_size"),
    "data.validation_shuffle": Note("offstep validates in file order"),
    "data.seed": Note("trainer.seed seeds offstep's prompt order"),
    "data.use_shm": Note("loading tuning"),
    "data.trust_remote_code": Note("offstep loads tokenizers without remote code"),
    "data.image_key": To("data.image_key"),
    "data.video_key": Note("offstep's prompts take images, not videos"),
    "data.return_multi_modal_inputs": Note("offstep computes the images' pixel values itself (docs/multimodal.md)"),
    "data.image_patch_size": Note("offstep takes the patch size from the model's image processor"),
    "data.tokenizer": Refuse("offstep loads the tokenizer from model.path", allow=(None,)),
    "data.custom_cls.path": Refuse(
        "offstep reads verl parquet and JSONL itself (data.prompt_key, data.answer_key)", allow=(None,)
    ),
    "data.custom_cls.name": Note("used only with data.custom_cls.path"),
    "data.sampler.class_path": Refuse(
        "offstep's prompt order is a seeded shuffle per epoch (data.shuffle)", allow=(None,)
    ),
    "data.sampler.class_name": Note("used only with data.sampler.class_path"),
    "data.datagen.path": Refuse("offstep's data are files or a built-in data.task", allow=(None,)),
    "data.datagen.name": Note("used only with data.datagen.path"),
    "data.tool_config_path": Note(
        "verl's dataset reads it to count the tool schemas in prompt lengths; offstep's tools come from actor_rollout_ref.rollout.multi_turn.tool_config_path (rollout.agent.tool_config_path)"
    ),
    "data.apply_chat_template_kwargs": Refuse("offstep applies the chat template with its defaults", allow=({}, None)),
    # reward
    "custom_reward_function.path": To("reward.custom_path"),
    "custom_reward_function.name": To("reward.custom_name", function_name),
    "reward_model.enable": Derived(
        "reward.model.kind", "True: discriminative, with reward_model.model.path (docs/reward-models.md)"
    ),
    "reward_model.model.path": Derived("reward.model.path", "with reward_model.enable=True"),
    "reward_model.micro_batch_size_per_gpu": Derived(
        "reward.model.batch_size", "with reward_model.enable=True; per replica"
    ),
    "reward_model.micro_batch_size": Derived("reward.model.batch_size", "with reward_model.enable=True; per replica"),
    "reward_model.model.trust_remote_code": Derived("reward.model.trust_remote_code", "with reward_model.enable=True"),
    "reward_model.max_length": Derived("reward.model.max_length", "with reward_model.enable=True"),
    "distillation.enabled": Derived(
        "distill.teacher.path", "True: a teacher, with distillation.teacher_model.model_path (docs/distillation.md)"
    ),
    "distillation.teacher_model.model_path": Derived("distill.teacher.path", "with distillation.enabled=True"),
    "distillation.teacher_model.enable_resource_pool": Derived("distill.teacher.placement", "True: pool"),
    "distillation.num_workers": Derived("resources.teacher_workers", "with enable_resource_pool=True"),
    "distillation.distillation_loss.loss_mode": Derived(
        "distill.loss_mode", "k1 with use_policy_gradient=True; forward_kl_topk with use_policy_gradient=False"
    ),
    "distillation.distillation_loss.use_policy_gradient": Derived("distill.loss_mode", "with loss_mode"),
    "distillation.distillation_loss.topk": Derived("distill.topk", "with distillation.enabled=True"),
    "distillation.distillation_loss.use_task_rewards": Derived(
        "distill.use_task_rewards", "with distillation.enabled=True"
    ),
    "distillation.distillation_loss.distillation_loss_coef": Derived("distill.coef", "with distillation.enabled=True"),
    "distillation.distillation_loss.log_prob_min_clamp": Derived(
        "distill.log_prob_min_clamp", "with distillation.enabled=True"
    ),
    "distillation.distillation_loss.loss_max_clamp": Note(
        "offstep bounds the k1 signal by log_prob_min_clamp; its top-k term is a KL of renormalised distributions"
    ),
    "reward_model.model.input_tokenizer": Note(
        "offstep always renders the chat with the reward model's own tokenizer and chat template"
    ),
    "reward_model.reward_manager": Refuse(
        "offstep scores one response per call (naive); DAPO's overlong buffer is algorithm.overlong_penalty",
        allow=("naive", "dapo"),
    ),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": To("algorithm.overlong_penalty"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": To("algorithm.overlong_buffer_len"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": To("algorithm.overlong_penalty_factor"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": Note("offstep always logs reward/overlong_penalty"),
    "reward_model.reward_kwargs.max_resp_len": Note("offstep's overlong penalty uses rollout.max_new_tokens"),
    "reward_model.overlong_buffer.enable": To("algorithm.overlong_penalty"),  # the DAPO recipe's own keys
    "reward_model.overlong_buffer.len": To("algorithm.overlong_buffer_len"),
    "reward_model.overlong_buffer.penalty_factor": To("algorithm.overlong_penalty_factor"),
    "reward_model.overlong_buffer.log": Note("offstep always logs reward/overlong_penalty"),
    "reward_model.launch_reward_fn_async": Note("offstep scores each response as it finishes, beside the rollout"),
    "reward_model.num_workers": To("reward.num_threads"),
    "reward_manager.name": Refuse(
        "offstep scores one response per call (naive)",
        allow=("naive", "${oc.select:reward_model.reward_manager,naive}"),
    ),
    # algorithm (shared names keep verl's meaning)
    "algorithm.adv_estimator": To("algorithm.adv_estimator", estimator),
    "algorithm.norm_adv_by_std_in_grpo": To("algorithm.norm_adv_by_std"),
    "algorithm.gamma": To("algorithm.gamma"),
    "algorithm.lam": To("algorithm.lam"),
    "algorithm.use_kl_in_reward": To("algorithm.use_kl_in_reward"),
    "algorithm.kl_penalty": To("algorithm.kl_penalty", kl_type),
    "algorithm.kl_ctrl.type": To("algorithm.kl_ctrl.type"),
    "algorithm.kl_ctrl.kl_coef": To("algorithm.kl_ctrl.kl_coef"),
    "algorithm.kl_ctrl.horizon": To("algorithm.kl_ctrl.horizon"),
    "algorithm.kl_ctrl.target_kl": To("algorithm.kl_ctrl.target_kl"),
    "algorithm.use_pf_ppo": Refuse("offstep weighs every sample equally (no PF-PPO reweighting)", allow=(False,)),
    "algorithm.rollout_correction.bypass_mode": Derived("algorithm.correction_mode", "true: bypass; false: decoupled"),
    "algorithm.rollout_correction.rollout_is": Derived(
        "algorithm.tis, algorithm.tis_level", "null: tis=false; token | sequence"
    ),
    "algorithm.rollout_correction.rollout_is_threshold": Derived(
        "algorithm.tis_cap, algorithm.tis", "a number: the cap; null: no importance weights (tis=false), as in verl"
    ),
    "algorithm.rollout_correction.rollout_rs": Derived(
        "algorithm.rejection_level, rejection_kl", "token_k1, seq_sum_k1, seq_mean_k1, seq_mean_k3 (comma-separated)"
    ),
    "algorithm.rollout_correction.rollout_rs_threshold": Derived(
        "algorithm.rejection_ratio_low/high, rejection_kl",
        "k1 'lower_upper' bounds pi_rollout/pi_old: low = 1/upper, high = 1/lower",
    ),
    "algorithm.rollout_correction.loss_type": Refuse(
        "offstep's off-policy correction multiplies the chosen surrogate (algorithm.policy_loss)", allow=("ppo_clip",)
    ),
    "algorithm.rollout_correction.rollout_is_batch_normalize": Refuse(
        "offstep's importance weights are truncated, not renormalised per batch", allow=(False,)
    ),
    # critic (shared names)
    "critic.optim.lr": To("critic.optim.lr"),
    "critic.optim.weight_decay": To("critic.optim.weight_decay"),
    "critic.optim.betas": To("critic.optim.betas"),
    "critic.optim.clip_grad": To("critic.optim.grad_clip"),
    "critic.grad_clip": To("critic.optim.grad_clip"),
    "critic.optim.lr_warmup_steps": Derived("critic.optim.warmup_steps", "-1: from lr_warmup_steps_ratio"),
    "critic.optim.lr_warmup_steps_ratio": Derived("critic.optim.warmup_steps", "int(ratio x trainer.total_steps)"),
    "critic.optim.lr_scheduler_type": To("critic.optim.lr_scheduler_type", schedule_name),
    "critic.optim.warmup_style": To("critic.optim.lr_scheduler_type", schedule_name),  # verl's older name
    "critic.optim.min_lr_ratio": To("critic.optim.min_lr_ratio"),
    "critic.optim.num_cycles": To("critic.optim.num_cycles"),
    "critic.ppo_epochs": To("critic.ppo_epochs"),
    "critic.cliprange_value": To("critic.value_clip"),
    "critic.model.path": Derived(
        "(checked)", "must be actor_rollout_ref.model.path: offstep's critic is the policy's model with a value head"
    ),
    "critic.strategy": Refuse(MEGATRON, allow=("fsdp", "fsdp2")),
    "critic.enable": Note("offstep trains a critic exactly when algorithm.adv_estimator=gae"),
    "critic.ppo_mini_batch_size": Note("offstep's critic uses the actor's mini-batches"),
    "critic.ppo_micro_batch_size_per_gpu": Note("offstep's critic uses actor.micro_batch_size"),
    "critic.ppo_micro_batch_size": Note("offstep's critic uses actor.micro_batch_size"),
    "critic.use_dynamic_bsz": Note("offstep's critic uses actor.micro_token_budget"),
    "critic.ppo_max_token_len_per_gpu": Note("offstep's critic uses actor.micro_token_budget"),
    "critic.forward_max_token_len_per_gpu": Note("offstep's critic uses actor.micro_token_budget"),
    "critic.forward_micro_batch_size_per_gpu": Note("offstep's critic uses actor.micro_batch_size"),
    "critic.loss_agg_mode": Note("offstep's value loss uses algorithm.loss_agg_mode"),
    "critic.shuffle": Refuse("offstep takes the mini-batches of a step in batch order", allow=(False,)),
    "critic.ulysses_sequence_parallel_size": Note(ULYSSES),
    # trainer
    "trainer.total_training_steps": Derived("trainer.total_steps", "the same number; null: from total_epochs"),
    "trainer.total_epochs": Derived(
        "trainer.total_steps",
        "epochs x floor(training rows / data.train_batch_size), as verl's dataloader (unless total_training_steps; fully-async: caps rollout.total_rollout_steps)",
    ),
    "trainer.n_gpus_per_node": Derived(
        "resources.trainer_workers, gpus_per_trainer_worker",
        "x trainer.nnodes workers, one GPU each (CPU workers where no GPU is visible)",
    ),
    "trainer.nnodes": Derived("resources.trainer_workers", "x trainer.n_gpus_per_node"),
    "rollout.n_gpus_per_node": Derived(
        "rollout.replicas, rollout.gpus_per_replica",
        "x rollout.nnodes replicas, one GPU each (CPU replicas where no GPU is visible)",
    ),
    "rollout.nnodes": Derived("rollout.replicas", "x rollout.n_gpus_per_node"),
    "trainer.project_name": To("trainer.wandb_project"),
    "trainer.experiment_name": To("trainer.wandb_run_name"),
    "trainer.logger": To("trainer.loggers", loggers),  # + jsonl: offstep always writes metrics.jsonl
    "trainer.save_freq": To("trainer.save_freq", never),
    "trainer.test_freq": To("trainer.val_freq", never_validate),
    "trainer.val_before_train": To("trainer.val_before_train"),
    "trainer.val_only": Refuse("use `offstep eval MODEL --data FILE` to validate without training", allow=(False,)),
    "trainer.critic_warmup": To("critic.warmup_steps"),
    "trainer.default_local_dir": To(
        "trainer.output_dir", note="offstep writes the run's config, metrics and checkpoints there"
    ),
    "trainer.resume_mode": Derived("trainer.resume", "auto: auto; disable: off; resume_path: trainer.resume_from_path"),
    "trainer.resume_from_path": Derived("trainer.resume", "with resume_mode=resume_path"),
    "trainer.max_actor_ckpt_to_keep": To("trainer.keep_checkpoints", zero_if_null),
    "trainer.max_critic_ckpt_to_keep": Note("offstep keeps trainer.keep_checkpoints whole checkpoints (every role)"),
    "trainer.default_hdfs_dir": Refuse("offstep writes checkpoints to trainer.output_dir only", allow=(None,)),
    "trainer.del_local_ckpt_after_load": Note("offstep keeps its checkpoints (trainer.keep_checkpoints)"),
    "trainer.log_val_generations": Note(
        "offstep writes trainer.log_samples_count generations to samples.jsonl every trainer.log_samples_freq steps"
    ),
    "trainer.rollout_data_dir": Note("offstep writes generations to <output_dir>/samples.jsonl"),
    "trainer.validation_data_dir": Note("offstep writes generations to <output_dir>/samples.jsonl"),
    "trainer.balance_batch": Note("offstep balances micro-batches by tokens (actor.micro_token_budget, on by default)"),
    "trainer.esi_redundant_time": Note("offstep saves on SIGTERM when trainer.save_freq > 0"),
    "trainer.ray_wait_register_center_timeout": Note("offstep starts its workers itself"),
    "trainer.use_legacy_worker_impl": Note("offstep has one worker implementation"),
    "trainer.device": To("trainer.device"),
    # verl's fully-async trainer (verl/experimental/fully_async_policy): any of the async_training
    # and fully-async rollout.* keys makes the command verl's fully-async one (fully_async_mode)
    "async_training.staleness_threshold": Derived(
        "pipeline.max_staleness",
        "ceil(threshold): verl lets that fraction of a step's prompts be generated ahead, so a sample ends at most ceil(threshold) versions behind; offstep bounds the version of a sample's oldest token",
    ),
    "async_training.trigger_parameter_sync_step": Derived(
        "data.train_batch_size",
        "trigger_parameter_sync_step x require_batches x ppo_mini_batch_size prompts: the trainer updates between two weight syncs, one offstep step",
    ),
    "async_training.require_batches": Derived(
        "data.train_batch_size", "with trigger_parameter_sync_step (verl's default 1)"
    ),
    "async_training.partial_rollout": Derived(
        "rollout.partial",
        "true: recompute (verl aborts in-flight requests at a load and resubmits prompt + tokens so far under the new weights); false: off",
    ),
    "async_training.use_rollout_log_probs": Derived(
        "algorithm.correction_mode",
        "true: bypass (the rollout's log-probs are PPO's old ones), unless compute_prox_log_prob; false: decoupled",
    ),
    "async_training.compute_prox_log_prob": Derived(
        "algorithm.correction_mode",
        "true: decoupled (the trainer's log-probs with the weights the step starts from, as verl's)",
    ),
    "async_training.use_trainer_do_validate": Note(
        "where verl validates (on the trainer's devices too); offstep validates every trainer.val_freq steps itself"
    ),
    "rollout.total_rollout_steps": Derived(
        "trainer.total_steps",
        "floor(min(prompts, rows x total_epochs) / data.train_batch_size): verl's weight versions",
    ),
    "rollout.total_epochs": Derived(
        "trainer.total_steps", "caps rollout.total_rollout_steps at rows x epochs, with trainer.total_epochs"
    ),
    "rollout.test_freq": Derived(
        "trainer.val_freq",
        "every N weight versions = N offstep steps (verl's fully-async trainer reads it, not trainer.test_freq); -1: never",
    ),
    "data.gen_batch_size": Derived(
        "algorithm.dynamic_sampling_max_attempts",
        "with filter_groups: the prompts of a verl generation round (offstep's rounds have data.train_batch_size); without: data.train_batch_size, or 1 (fully-async)",
    ),
    "algorithm.filter_groups.enable": Derived(
        "algorithm.dynamic_sampling",
        "DAPO's dynamic sampling: groups whose metric is equal are dropped and more are generated",
    ),
    "algorithm.filter_groups.metric": Derived(
        "(checked)",
        "acc, score: offstep filters on the score; seq_reward: unless the overlong penalty is on; seq_final_reward: unless it or the KL in the reward is on",
    ),
    "algorithm.filter_groups.max_num_gen_batches": Derived(
        "algorithm.dynamic_sampling_max_attempts",
        "ceil(N x gen_batch_size / train_batch_size) rounds; 0 (verl: unlimited): offstep's default, with a note",
    ),
    "actor_rollout_ref.rollout.enable_sleep_mode": Note(ENGINE),
    "actor_rollout_ref.actor.optim.lr_decay_style": Refuse(
        "offstep's schedule is a linear warm-up, then constant", allow=("constant",)
    ),
    "actor_rollout_ref.actor.optim.lr_decay_steps": Note("used only by verl's decaying schedules"),
}

PREFIXES: list[tuple[str, To | Note | Refuse]] = [
    ("actor_rollout_ref.actor.megatron.", Refuse(MEGATRON)),
    ("actor_rollout_ref.ref.megatron.", Refuse(MEGATRON)),
    ("critic.megatron.", Refuse(MEGATRON)),
    ("actor_rollout_ref.actor.fsdp_config.", Note(FSDP)),
    ("actor_rollout_ref.ref.fsdp_config.", Note(FSDP)),
    ("critic.model.fsdp_config.", Note(FSDP)),
    ("critic.model.", Note("offstep's critic is the policy's model with a value head")),
    ("actor_rollout_ref.actor.policy_loss.", Note("parameters of verl loss modes that offstep does not offer")),
    (
        "actor_rollout_ref.actor.checkpoint.",
        Note("offstep's checkpoints always hold the model, the optimizer and the run's state"),
    ),
    ("critic.checkpoint.", Note("offstep's checkpoints always hold the model, the optimizer and the run's state")),
    ("actor_rollout_ref.actor.profiler.", Note(PROFILE)),
    ("actor_rollout_ref.ref.profiler.", Note(PROFILE)),
    ("actor_rollout_ref.rollout.profiler.", Note(PROFILE)),
    ("critic.profiler.", Note(PROFILE)),
    ("global_profiler.", Note(PROFILE)),
    ("actor_rollout_ref.actor.router_replay.", Note("MoE routing replay, which offstep does not have")),
    ("actor_rollout_ref.ref.router_replay.", Note("MoE routing replay, which offstep does not have")),
    ("actor_rollout_ref.rollout.engine_kwargs.", Note(ENGINE)),
    ("actor_rollout_ref.rollout.trace.", Note(PROFILE)),
    ("actor_rollout_ref.rollout.prometheus.", Note(PROFILE)),
    ("actor_rollout_ref.rollout.agent.", Note("offstep's rollout workers run their samples themselves")),
    (
        "actor_rollout_ref.rollout.multi_turn.",
        Note("tool-loop settings offstep does not have (its own: rollout.agent)"),
    ),
    (
        "actor_rollout_ref.model.lora.",
        Note("verl's LoRA internals (adapter path, merge mode); offstep's LoRA is actor.lora"),
    ),
    (
        "reward_model.",
        Note("reward-model engine tuning that offstep's reward model on the rollout replicas does not use"),
    ),
    ("reward_manager.", Note("offstep scores one response per call")),
    ("ray_kwargs.", Note("offstep starts Ray itself; resources.ray_address joins an existing cluster")),
    ("transfer_queue.", Note("offstep passes batches through Ray's object store")),
    (
        "async_training.checkpoint_engine.",
        Note(
            "weight-transfer tuning: pipeline.mode=fully_async sends the weights by pipeline.weight_sync (object_store or collective), each load checked by its digest"
        ),
    ),
    ("actor_rollout_ref.model.fused_kernel_options.", Note("kernel choice; offstep uses PyTorch's")),
    (
        "actor_rollout_ref.model.override_config.",
        To(
            "model.override_config.",
            note="applied to the model's transformers config at load; a name it does not have is refused then",
        ),
    ),
    (
        "actor_rollout_ref.actor.optim.override_optimizer_config.",
        Refuse("offstep's AdamW takes only lr, betas, weight_decay"),
    ),
]


# The offstep keys each derivation may set (a direct offstep override of one of them conflicts).
DERIVED_TARGETS = {
    "trainer.n_gpus_per_node": ("resources.trainer_workers", "resources.gpus_per_trainer_worker"),
    "trainer.nnodes": ("resources.trainer_workers", "resources.gpus_per_trainer_worker"),
    "rollout.n_gpus_per_node": ("rollout.replicas", "rollout.gpus_per_replica"),
    "rollout.nnodes": ("rollout.replicas", "rollout.gpus_per_replica"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": ("actor.mini_batch_size",),
    "actor_rollout_ref.actor.ppo_micro_batch_size": ("actor.micro_batch_size",),
    "actor_rollout_ref.actor.use_dynamic_bsz": ("actor.micro_token_budget",),
    "trainer.total_epochs": ("trainer.total_steps",),
    "trainer.total_training_steps": ("trainer.total_steps",),
    "actor_rollout_ref.rollout.name": ("rollout.engine",),
    "algorithm.rollout_correction.bypass_mode": ("algorithm.correction_mode",),
    "algorithm.rollout_correction.rollout_is": ("algorithm.tis", "algorithm.tis_level"),
    "algorithm.rollout_correction.rollout_rs": (
        "algorithm.rejection_level",
        "algorithm.rejection_ratio_low",
        "algorithm.rejection_ratio_high",
        "algorithm.rejection_kl",
    ),
    "data.filter_overlong_prompts": ("data.overlong_prompts",),
    "data.truncation": ("data.overlong_prompts",),
    "algorithm.rollout_correction.rollout_is_threshold": ("algorithm.tis_cap", "algorithm.tis"),
    "algorithm.filter_groups.enable": ("algorithm.dynamic_sampling",),
    "algorithm.filter_groups.max_num_gen_batches": ("algorithm.dynamic_sampling_max_attempts",),
    "trainer.resume_mode": ("trainer.resume",),
    "async_training.staleness_threshold": ("pipeline.max_staleness",),
    "async_training.partial_rollout": ("rollout.partial",),
    "async_training.use_rollout_log_probs": ("algorithm.correction_mode",),
    "async_training.compute_prox_log_prob": ("algorithm.correction_mode",),
    "rollout.total_rollout_steps": ("trainer.total_steps",),
    "rollout.total_epochs": ("trainer.total_steps",),
    "rollout.test_freq": ("trainer.val_freq",),
    "reward_model.enable": ("reward.model.kind", "reward.model.path"),
    "reward_model.model.path": ("reward.model.path",),
    "reward_model.micro_batch_size_per_gpu": ("reward.model.batch_size",),
    "reward_model.micro_batch_size": ("reward.model.batch_size",),
    "reward_model.model.trust_remote_code": ("reward.model.trust_remote_code",),
    "reward_model.max_length": ("reward.model.max_length",),
    "distillation.enabled": ("distill.teacher.path",),
    "distillation.teacher_model.model_path": ("distill.teacher.path",),
    "distillation.teacher_model.enable_resource_pool": ("distill.teacher.placement",),
    "distillation.num_workers": ("resources.teacher_workers",),
    "distillation.distillation_loss.loss_mode": ("distill.loss_mode",),
    "distillation.distillation_loss.use_policy_gradient": ("distill.loss_mode",),
    "distillation.distillation_loss.topk": ("distill.topk",),
    "distillation.distillation_loss.use_task_rewards": ("distill.use_task_rewards",),
    "distillation.distillation_loss.distillation_loss_coef": ("distill.coef",),
    "distillation.distillation_loss.log_prob_min_clamp": ("distill.log_prob_min_clamp",),
}


def prefix_of(key: str) -> str:
    """The longest prefix of ``PREFIXES`` that ``key`` starts with ("" if none)."""
    return max((p for p, _ in PREFIXES if key.startswith(p)), key=len, default="")


def rule_for(key: str) -> To | Derived | Note | Refuse | None:
    """The entry for a verl key: exact first, then the longest prefix; None for a key the table
    does not know."""
    if key in TABLE:
        return TABLE[key]
    return next((rule for prefix, rule in sorted(PREFIXES, key=lambda p: -len(p[0])) if key.startswith(prefix)), None)
