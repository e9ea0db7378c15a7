"""Rewards: rule-based scorers and the scorer registry."""

from offstep.rewards.registry import (
    BUILTIN_SCORERS,
    RewardConfigError,
    RewardError,
    RewardFunction,
    load_custom_scorer,
)
from offstep.rewards.scorers import gsm8k_score, last_number_score

__all__ = [
    "BUILTIN_SCORERS",
    "RewardConfigError",
    "RewardError",
    "RewardFunction",
    "gsm8k_score",
    "last_number_score",
    "load_custom_scorer",
]
