"""A worker of the reward pool (``reward.model.placement=pool``): one reward model, scoring the
batches the rollout replicas send it (``offstep.rollout.scoring.replica_reward_model.PoolScorer``)."""

from __future__ import annotations

import torch

from offstep.config.schema import RewardModelConfig
from offstep.rollout.scoring.replica_reward_model import Item, make_scorer


class RewardWorker:
    def __init__(self, cfg: RewardModelConfig, device: str, num_threads: int):
        torch.set_num_threads(num_threads)
        self.scorer = make_scorer(cfg, torch.device("cuda" if device == "cuda" else "cpu"))

    def score(self, items: list[Item]) -> list[float | None]:
        return self.scorer(items)
