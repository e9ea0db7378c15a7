"""Pure RL algorithm maths: masked reductions, advantages, losses, off-policy correction, KL
control and DAPO's reward shaping. docs/algorithms.md maps each to its paper and config key.

Everything here is a function of tensors and floats (no configs, no models). Response tensors are
right-padded ``[B, R]`` with a ``response_mask`` (1 on real response tokens, 0 on padding), and
padded entries never affect a result.
"""

from offstep.algos.advantages import (
    gae_advantage,
    grpo_outcome_advantage,
    outcome_token_rewards,
    reinforce_pp_advantage,
    reinforce_pp_baseline_advantage,
    remax_advantage,
    rloo_advantage,
)
from offstep.algos.common import (
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from offstep.algos.correction import (
    GroupedTokenStats,
    mismatch_kl_terms,
    rejection_mask,
    truncated_flags,
    truncated_importance_weights,
)
from offstep.algos.dapo import dynamic_sampling_keep, overlong_penalty
from offstep.algos.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    kl_controller,
    kl_penalized_rewards,
)
from offstep.algos.losses import (
    clipped_policy_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    value_loss,
)
from offstep.algos.policy_losses import (
    cispo_policy_loss,
    gspo_policy_loss,
    pg_policy_loss,
    policy_loss,
)

__all__ = [
    "AdaptiveKLController",
    "FixedKLController",
    "GroupedTokenStats",
    "aggregate_loss",
    "cispo_policy_loss",
    "clipped_policy_loss",
    "dynamic_sampling_keep",
    "entropy_from_logits",
    "gae_advantage",
    "grpo_outcome_advantage",
    "gspo_policy_loss",
    "kl_controller",
    "kl_penalized_rewards",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mismatch_kl_terms",
    "outcome_token_rewards",
    "overlong_penalty",
    "pg_policy_loss",
    "policy_loss",
    "reinforce_pp_advantage",
    "reinforce_pp_baseline_advantage",
    "rejection_mask",
    "remax_advantage",
    "rloo_advantage",
    "truncated_flags",
    "truncated_importance_weights",
    "value_loss",
]
