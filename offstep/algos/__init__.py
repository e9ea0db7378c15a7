"""Pure RL algorithm maths: masked reductions, advantages, losses, off-policy correction.

Everything here is a function of tensors and floats (no configs, no models). Response tensors are
right-padded ``[B, R]`` with a ``response_mask`` (1 on real response tokens, 0 on padding), and
padded entries never affect a result.
"""

from offstep.algos.advantages import gae_advantage, grpo_outcome_advantage
from offstep.algos.common import (
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from offstep.algos.correction import truncated_importance_weights
from offstep.algos.losses import (
    clipped_policy_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    value_loss,
)

__all__ = [
    "aggregate_loss",
    "clipped_policy_loss",
    "entropy_from_logits",
    "gae_advantage",
    "grpo_outcome_advantage",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "truncated_importance_weights",
    "value_loss",
]
