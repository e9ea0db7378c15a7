"""The allowed values of the configuration's choice keys, defined once.

The config checks (``offstep.launch.validate``) and the code that dispatches on the same names
(the algorithms, the rollout engines and agents, the loggers, the trainer) both read them from
here. This module imports nothing, so validating a config loads no torch; the import-linter
contract in pyproject.toml keeps it at the bottom layer.
"""

from __future__ import annotations

# algorithm.* (offstep.pipeline.compute_advantages and offstep.algos dispatch on these). GROUP_ESTIMATORS compare
# the responses to one prompt with each other: they need rollout.n >= 2.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk")
ADV_ESTIMATORS = (*GROUP_ESTIMATORS, "reinforce_plus_plus", "remax", "gae")
POLICY_LOSSES = ("ppo", "gspo", "cispo", "pg")
# The kinds of kl_penalty: "kl" is verl's name for k1; "+" marks the straight-through variants.
KL_ESTIMATORS = ("k1", "kl", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "kl+", "abs+", "low_var_kl+", "k3+")
KL_CONTROLLERS = ("fixed", "adaptive")
LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
TIS_LEVELS = ("token", "sequence")
REJECTION_LEVELS = ("off", "token", "sequence", "geometric")
M2PO_TOKENS = ("all", "trust_region")  # algorithm.m2po_tokens
ONE_RESPONSE_GROUPS = ("zero", "score")  # algorithm.one_response_groups
SCORE_ALONE_ESTIMATORS = ("grpo", "rloo", "opo")  # the estimators where one_response_groups=score applies
CORRECTION_MODES = ("decoupled", "bypass", "off")  # no table: the actor and the controller compare with each name

# rollout.*
ROLLOUT_ENGINES = ("builtin", "vllm")
# rollout.partial: how a replica continues its in-flight samples across a weight load
# (pipeline.mode=fully_async): keep their KV cache (computed under the old weights), recompute it
# under the new weights, or off (finish them before the load; no sample crosses a load)
PARTIAL_MODES = ("keep", "recompute", "off")
SLEEP_MODES = ("auto", "true", "false")  # rollout.sleep_during_update (offstep.config.schema.rollout_sleeps)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks (v0.32)
SINGLE_TURN, TOOL_AGENT, OPENAI_AGENT = "single_turn_agent", "tool_agent", "openai"
AGENT_NAMES = (
    SINGLE_TURN,
    TOOL_AGENT,
    OPENAI_AGENT,
)  # verl's agent_name values that offstep runs (rollout.agent.default_agent)
TOOL_FORMATS = (
    "hermes",
    "tag",
)  # rollout.agent.format: how tool calls are written (offstep.rollout.agents.tool_parsers)
TOOL_ROLES = ("tool", "user")  # rollout.agent.tool_role

# reward.model.* (offstep.rewards.combine, offstep.rewards.judge and offstep.rollout.scoring.replica_reward_model dispatch on these)
REWARD_MODEL_KINDS = ("discriminative", "generative")
REWARD_COMBINE = ("weighted", "abstain")
REWARD_PLACEMENTS = ("rollout", "pool")
DISTILL_LOSS_MODES = ("k1", "forward_kl_topk")  # distill.loss_mode
JUDGE_PARSERS = ("last_number", "yes_no")  # and regex:PATTERN
JUDGE_TEMPLATES = (
    "score",
    "yes_no",
)  # reward.model.template names (texts in offstep.rewards.judge), or a template of its own

# pipeline.*, trainer.*, model.*, data.*, actor.* / critic.*
WEIGHT_SYNC_PATHS = ("object_store", "collective")
PIPELINE_MODES = ("batch", "fully_async")  # pipeline.mode
DEVICES = ("auto", "cpu", "cuda")
PROGRESS_MODES = ("auto", "bar", "plain", "off")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
WANDB_MODES = ("offline", "online", "disabled")  # trainer.wandb_mode also takes "" ($WANDB_MODE, else offline)
DTYPE_NAMES = ("float32", "bfloat16")  # model.dtype, model.compute_dtype, rollout.dtype
OVERLONG_MODES = ("filter", "error", "left", "right", "middle")  # data.overlong_prompts
TRUNCATIONS = ("left", "right", "middle")  # the OVERLONG_MODES that cut a prompt (verl's data.truncation)
NONFINITE_POLICIES = ("skip", "stop")  # actor.nonfinite, critic.nonfinite
LR_SCHEDULES = ("constant", "cosine")  # actor.optim.lr_scheduler_type, critic.optim.lr_scheduler_type
