"""From a scored batch to advantages and returns: the estimator chosen by
``algorithm.adv_estimator``, applied in the driver between the reference/critic forward passes
and the updates. The maths lives in ``offstep.algos`` (pure functions); this module only picks
and feeds them."""

from __future__ import annotations

import torch

from offstep.algos.advantages import gae_advantage, grpo_outcome_advantage
from offstep.batch import TrainBatch
from offstep.config.schema import AlgorithmConfig


def compute_advantages(batch: TrainBatch, algo: AlgorithmConfig) -> dict[str, float]:
    """Set ``batch.advantages`` and ``batch.returns``; return metrics."""
    mask = batch.response_mask
    if algo.adv_estimator == "grpo":
        batch.advantages, batch.returns = grpo_outcome_advantage(
            batch.scores, batch.group_ids, mask, norm_by_std=algo.norm_adv_by_std
        )
    else:
        last = (mask.sum(-1).long() - 1).clamp(min=0)
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(batch)), last] = batch.scores
        batch.advantages, batch.returns = gae_advantage(
            token_rewards, batch.values, mask, gamma=algo.gamma, lam=algo.lam
        )
    return {}
