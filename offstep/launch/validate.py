"""Checks a config's consistency before any process starts: every message names the key and the
fix. Nothing here looks outside the config (files, packages, devices, the network): those checks
are ``offstep.launch.preflight``'s, which runs these too (``problems``) and reports both together."""

from __future__ import annotations

import difflib
import inspect
import math

from offstep.config.choices import (
    DEVICES,
    DTYPE_NAMES,
    LOGGERS,
    NONFINITE_POLICIES,
    OVERLONG_MODES,
    PROGRESS_MODES,
    WANDB_MODES,
    WEIGHT_SYNC_PATHS,
)
from offstep.config.schema import Config
from offstep.data.vision_refusals import images_expected, vision_problems
from offstep.launch.checks import choice, floats, need
from offstep.launch.validate_rollout import (
    check_agent,
    check_engine,
    check_lending,
    check_lora,
    check_mode,
    check_reward_model,
)
from offstep.launch.validate_training import check_algorithm, check_distill, check_optim

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
    check_lending(cfg, e)
    if images_expected(cfg):  # tiny_vl or an image task; a VL folder of one's own: when its rows are read
        e.extend(vision_problems(cfg))
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
    check_engine(cfg, e)
    check_mode(cfg, e)
    check_agent(cfg, e)
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
    check_reward_model(cfg, e)
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
    check_lora(cfg, e)
    return e
