"""A sample's reward from a rule score and a model score (``reward.model.combine``).

``weighted``: ``rule_weight * rule + weight * model``. ``abstain``: the rule's score, and the
model's where the rule abstains (a custom scorer returned None). Both components go into the
sample's ``reward_extra`` (``RULE``, ``MODEL``), from which the step logs ``reward/rule/mean``
and ``reward/model/mean``; a model score that fell back (timeout, failure, an unparseable
judgement) is marked with ``FALLBACK`` and counted in ``reward/model/fallbacks``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from offstep.config.schema import RewardModelConfig
from offstep.errors import RewardError
from offstep.rewards.registry import RewardFunction
from offstep.rewards.sources import builtin_scorer

# reward_extra keys (offstep's own, beside what a custom scorer returns)
RULE, MODEL, FALLBACK = "reward_rule", "reward_model", "reward_model_fallback"


def combine(rule: float | None, model: float | None, mode: str, weight: float, rule_weight: float) -> float:
    """The reward of one sample. ``rule`` is None where the rule abstained (or, with a model alone,
    where no scorer exists); ``model`` is None where the model was not asked."""
    if mode == "abstain":
        if rule is not None:
            return rule
        if model is None:
            raise ValueError("combine=abstain: the rule abstained and no model score was given")
        return model
    if mode != "weighted":
        raise ValueError(f"unknown combine mode {mode!r}")
    total = weight * model if weight != 0 else 0.0
    if rule_weight != 0:
        if rule is None:
            raise ValueError("combine=weighted with rule_weight != 0 needs a rule score")
        total += rule_weight * rule
    return total


@dataclass(frozen=True)
class ModelScore:
    """A model's score of one sample: ``value`` is None when it fell back, and ``status`` says why
    (``ok`` | ``timeout`` | ``failed`` | ``unparsed``)."""

    value: float | None
    status: str = "ok"


class ModelScorer(Protocol):
    def __call__(self, prompt: list[dict], response: str, ground_truth: Any) -> ModelScore: ...


@dataclass
class Combination:
    """``reward.model``'s combining settings."""

    mode: str = "weighted"
    weight: float = 1.0
    rule_weight: float = 0.0
    fallback_score: float = 0.0
    needs_rule: bool = True

    @classmethod
    def of(cls, m: RewardModelConfig) -> "Combination":
        return cls(m.combine, m.weight, m.rule_weight, m.fallback_score, m.combine == "abstain" or m.rule_weight != 0)


class SampleReward:
    """Scores one sample with the rule, the model, or both; called on the rollout worker's scoring
    threads as samples finish. Without a model it is the rule alone (``RewardFunction``)."""

    def __init__(
        self, rule: RewardFunction, model: ModelScorer | Callable | None = None, how: Combination | None = None
    ):
        self.rule, self.model, self.how = rule, model, how or Combination()

    def _has_rule(self, data_source: str) -> bool:
        return self.how.needs_rule or bool(self.rule.custom_path) or builtin_scorer(data_source) is not None

    def __call__(
        self,
        data_source: str,
        solution_str: str,
        ground_truth: Any,
        extra_info: dict | None = None,
        prompt: list[dict] | None = None,
    ) -> tuple[float, dict]:
        if self.model is None:
            return self.rule(data_source, solution_str, ground_truth, extra_info)
        how = self.how
        rule, extras = (
            self.rule(data_source, solution_str, ground_truth, extra_info)
            if self._has_rule(data_source)
            else (None, {})
        )
        extras = dict(extras)
        if rule is not None:
            extras[RULE] = float(rule)
        model = None
        if how.mode == "weighted" and how.weight != 0 or how.mode == "abstain" and rule is None:
            scored = self.model(list(prompt or []), solution_str, ground_truth)
            model = how.fallback_score if scored.value is None else float(scored.value)
            extras[MODEL] = model
            extras[FALLBACK] = float(scored.value is None)
        try:
            return combine(rule, model, how.mode, how.weight, how.rule_weight), extras
        except ValueError as exc:
            raise RewardError(f"reward for data source {data_source!r}: {exc}") from exc
