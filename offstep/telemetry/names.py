"""The names a run's records use, defined once: the metric keys of ``metrics.jsonl``, the roles
(lanes) and stages of ``timeline.jsonl`` and of the live status line.

The controller writes them, the console, the live status line and ``offstep report`` read them,
and the tests check them; all import them from here. They are plain strings, so the records are
the same JSON whoever writes them, and each metric group is a class named after its prefix
(``Timing.STEP`` is ``"timing_s/step"``). Names made from a pattern (a replica's lane, a worker's
metric, a data source's validation metric) have a function here. No torch, no Ray: any module
above ``offstep.telemetry`` in the layers may import it.
"""

from __future__ import annotations


class Role:
    """Who runs a stage: the lanes of the timeline and the status line (``TRAINER``, ``DRIVER``,
    :func:`replica`), and the trainer roles, whose names are also their checkpoint folders."""

    TRAINER = "trainer"  # the trainer pool, one lane for all its roles; also the pool's name
    DRIVER = "driver"  # the controller's own work on a batch
    ROLLOUT = "rollout"  # the rollout pool; replica i's lane is replica(i)
    ACTOR = "actor"
    CRITIC = "critic"
    REWARD = "reward"  # a reward model beside replica i: lane reward_lane(i)
    TEACHER = "teacher"  # the distillation teacher's pool (distill.teacher.placement=pool)


def replica(i: int) -> str:
    """Replica ``i``'s lane: ``rollout/0``, ``rollout/1``, ..."""
    return f"{Role.ROLLOUT}/{i}"


def reward_lane(i: int) -> str:
    """The lane of the reward model on replica ``i`` (``reward.model``): ``reward/0``, ..."""
    return f"{Role.REWARD}/{i}"


def replica_index(role: str) -> int | None:
    """``i`` for replica i's lane (``rollout/3`` -> 3), None for any other role."""
    head, _, tail = role.partition("/")
    return int(tail) if head == Role.ROLLOUT and tail.isdigit() else None


class Stage:
    """The stages of the timeline and of the status line."""

    # a rollout replica's
    GEN = "gen"
    GEN_MORE = "gen_more"  # dynamic sampling's further rounds
    VAL = "val"
    REF = "ref"  # also the trainer's reference pass
    TOOL = "tool"  # tools running, inside a generation
    LOAD_WEIGHTS = "load_weights"
    SLEEP = "sleep"  # the engine frees its device memory for the update (rollout.sleep_during_update)
    WAKE = "wake"  # and takes it back, for the load that follows
    REWARD_MODEL = "reward_model"  # a batch scored by the reward model, on its own lane
    TEACHER = "teacher"  # a batch scored by the distillation teacher, on the reward model's lane
    # the trainer's
    WAIT_GEN = "wait_gen"
    VALUES = "values"
    OLD_LOGPROBS = "old_logprobs"
    UPDATE_CRITIC = "update_critic"
    UPDATE_ACTOR = "update_actor"
    SYNC = "sync"
    SYNC_EXPORT = "sync_export"
    CHECKPOINT = "checkpoint"
    # the driver's
    PREPARE = "prepare"


# ---------------------------------------------------------------- metrics.jsonl, by group


class Timing:
    """``timing_s/``: seconds of a step and of its stages."""

    STEP = "timing_s/step"
    GEN = "timing_s/gen"
    WAIT_GEN = "timing_s/wait_gen"
    REF = "timing_s/ref"
    REF_ROLLOUT = "timing_s/ref_rollout"
    VALUES = "timing_s/values"
    OLD_LOGPROBS = "timing_s/old_logprobs"
    ADV = "timing_s/adv"
    UPDATE_CRITIC = "timing_s/update_critic"
    UPDATE_ACTOR = "timing_s/update_actor"
    SYNC_WEIGHTS = "timing_s/sync_weights"
    SYNC_VERIFY = "timing_s/sync_verify"
    ROLLOUT_SLEEP = "timing_s/rollout_sleep"  # the slowest replica's sleep (rollout.sleep_during_update)
    ROLLOUT_WAKE = "timing_s/rollout_wake"  # the slowest replica's wake, before and around its load
    REWARD_MODEL = "timing_s/reward_model"  # the slowest replica's seconds in reward-model batches
    TEACHER = "timing_s/teacher"  # the slowest replica's seconds waiting on the teacher's batches (distill.teacher)


class Perf:
    """``perf/``: throughput."""

    TOKENS_PER_S = "perf/tokens_per_s"
    SAMPLES_PER_S = "perf/samples_per_s"
    GEN_TOKENS_PER_S = "perf/gen_tokens_per_s"
    LENT_CORES_S = "perf/lent_cores_s"  # seconds of the step the trainer computed with the rollout's cores too


class Reward:
    """``reward/``: the batch's scores and the terms added to them."""

    MEAN = "reward/mean"
    MAX = "reward/max"
    MIN = "reward/min"
    # groups (of two samples or more) whose samples all scored the same: no GRPO signal; rising
    # with a falling actor/entropy, the policy is collapsing onto answers it always or never gets
    UNIFORM_GROUP_FRAC = "reward/uniform_group_frac"
    OVERLONG_PENALTY = "reward/overlong_penalty"
    KL_PENALTY = "reward/kl_penalty"
    KL_COEF = "reward/kl_coef"
    GREEDY_BASELINE = "reward/greedy_baseline"
    RULE_MEAN = "reward/rule/mean"  # reward.model: the rule's component, over the samples it scored
    MODEL_MEAN = "reward/model/mean"  # the model's component (fallbacks included)
    MODEL_FALLBACKS = "reward/model/fallbacks"  # samples given reward.model.fallback_score (timeout, failure, unparsed)


class Env:
    """``env/``: an environment's failed rollouts (``env.*``, offstep.envs): retried, then their groups dropped or the run stopped."""

    ERRORS = "env/errors"  # rollouts whose environment raised
    TIMEOUTS = "env/timeouts"  # rollouts over env.timeout_s
    DROPPED_GROUPS = "env/dropped_groups"  # groups left out of a batch for a rollout that failed for good
    PART_PREFIX = "reward/"  # an environment's reward parts: reward/<name>, weighted as in its rubric


class Rollout:
    """``rollout/``: how off-policy the batch is, and the state of its generation."""

    STALENESS_MAX = "rollout/staleness_max"
    STALENESS_MEAN = "rollout/staleness_mean"
    VERSION_MIN = "rollout/version_min"
    VERSION_SPAN_MAX = "rollout/version_span_max"
    PARTIAL_SAMPLES = "rollout/partial_samples"
    KV_AGE_MAX = (
        "rollout/kv_age_max"  # the most versions a trained sample's K/V lagged its weights (rollout.max_kv_age)
    )
    QUEUE_DEPTH = "rollout/queue_depth"
    IN_FLIGHT_GROUPS = "rollout/in_flight_groups"
    DROPPED_STALE = "rollout/dropped_stale"
    LENGTH_BIAS = "rollout/length_bias"
    OVER_SAMPLE_CUT = "rollout/over_sample_cut"  # samples rollout.over_sample_rate cut: generated, not trained on
    DYNAMIC_SAMPLING_ATTEMPTS = "rollout/dynamic_sampling_attempts"
    DYNAMIC_SAMPLING_FILLED_GROUPS = "rollout/dynamic_sampling_filled_groups"


class ResponseLength:
    """``response_length/``: tokens per response (tool turns included)."""

    MEAN = "response_length/mean"
    MAX = "response_length/max"
    CLIP_RATIO = "response_length/clip_ratio"
    GENERATED_MEAN = "response_length/generated_mean"


class Adv:
    """``adv/``: the advantages over the batch's response tokens."""

    MEAN = "adv/mean"
    ABS_MEAN = "adv/abs_mean"
    MAX = "adv/max"
    MIN = "adv/min"


class Distill:
    """``distill/``: on-policy distillation (``distill.teacher``), over the batch's response tokens."""

    REVERSE_KL = "distill/reverse_kl"  # mean per token of log p_student - log p_teacher (k1)
    TEACHER_LOGPROB = "distill/teacher_logprob"  # mean per token of the teacher's log-prob


class Actor:
    """``actor/``: the actor's update, :func:`actor` of each key it returns; those read by name."""

    PG_LOSS = "actor/pg_loss"
    KL = "actor/kl"
    ENTROPY = "actor/entropy"
    GRAD_NORM = "actor/grad_norm"
    MISMATCH_KL_K1 = "actor/mismatch_kl_k1"
    IS_WEIGHT_MEAN = "actor/is_weight_mean"
    FROZEN = "actor/frozen"  # the critic's warm-up holds the actor


def actor(key: str) -> str:
    """The record's name of a metric the actor's update returns (``pg_loss`` -> ``actor/pg_loss``)."""
    return f"{Role.ACTOR}/{key}"


def critic(key: str) -> str:
    """The record's name of a metric the critic's update returns (``vf_loss`` -> ``critic/vf_loss``)."""
    return f"{Role.CRITIC}/{key}"


class Sandbox:
    """``sandbox/``: the step's executions of model-written code (code rewards, the python tool)."""

    EXECUTIONS = "sandbox/executions"
    TIMEOUTS = "sandbox/timeouts"
    SECONDS_MEAN = "sandbox/seconds_mean"
    SECONDS_P95 = "sandbox/seconds_p95"
    QUEUE_WAIT_S = "sandbox/queue_wait_s"  # the mean wait for a free slot (sandbox.concurrency)


class Sync:
    """``sync/``: how the step's weights reached the replicas."""

    VERIFIED = "sync/verified"
    COLLECTIVE = "sync/collective"


class Val:
    """``val/``: validation (``offstep eval`` writes the same names without the prefix)."""

    PREFIX = "val/"
    ACC = "val/acc"
    ACC_STDERR = "val/acc_stderr"  # the standard error of val/acc over the held-out prompts
    POLICY_VERSION = "val/policy_version"


def per_source(prefix: str, source: str, name: str) -> str:
    """A data source's own validation metric: ``per_source("val/", "gsm8k", "acc")`` is
    ``val/gsm8k/acc``."""
    return f"{prefix}{source}/{name}"


class Data:
    """``data/``: which prompts a step trained on."""

    PROMPTS_CRC32 = "data/prompts_crc32"
