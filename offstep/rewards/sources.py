"""The built-in scorer of each data source, with verl's signature ``(data_source, solution_str,
ground_truth, extra_info=None, **kwargs)``: verl's ``default_compute_score`` routing for the math
family, geo3k, Search-R1 and code (the model's program run in ``offstep.sandbox``, by
``offstep.rewards.code``), plus offstep's own tasks (``gsm8k``, ``arithmetic``, ``calculator``, ``code``) and reasoning-gym's
(``reasoning_gym/<dataset>``, ``offstep.rewards.reasoning_gym_scorer``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from offstep.rewards.code import code_score
from offstep.rewards.math_answers import dapo_score, lighteval_math_score
from offstep.rewards.math_grade import geo3k_score, prime_math_score
from offstep.rewards.reasoning_gym_scorer import SOURCE_PREFIX as REASONING_GYM
from offstep.rewards.reasoning_gym_scorer import reasoning_gym_score
from offstep.rewards.scorers import gsm8k_score, last_number_score, plain_answer_score, search_r1_em_score

Scorer = Callable[..., Any]

MATH_LIGHTEVAL_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every name that starts with "aime"
DAPO_PREFIX = "aime"
NUMINA_SOURCES = (
    "numina_aops_forum",
    "numina_synthetic_math",
    "numina_amc_aime",
    "numina_synthetic_amc",
    "numina_cn_k12",
    "numina_olympiads",
)
SEARCH_R1_SOURCES = (
    "searchR1_nq",
    "searchR1_triviaqa",
    "searchR1_popqa",
    "searchR1_hotpotqa",
    "searchR1_2wikimultihopqa",
    "searchR1_musique",
    "searchR1_bamboogle",
)
DICT_TRUTH_SOURCES = SEARCH_R1_SOURCES  # their ground truth is {"target": [answers]}
# verl's default_compute_score sends these to its code scorer (prime_code): run the tests of the ground truth
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
CODE_TASK = "code"  # offstep's built-in task, in the same test format


def needs_sandbox(data_source: str) -> bool:
    """Whether the built-in scorer of ``data_source`` runs the model's code (in offstep.sandbox)."""
    return data_source in CODE_SOURCES or data_source == CODE_TASK


def _named(name: str, score: Callable[[str, Any], Any]) -> Scorer:
    """``score(solution_str, ground_truth)`` as a scorer with verl's signature, called ``name``."""

    def scorer(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return score(solution_str, ground_truth)

    scorer.__qualname__ = scorer.__name__ = name
    return scorer


def _gsm8k(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return gsm8k_score(solution_str, ground_truth, **kwargs)


CALCULATOR_CALL = "<calculator>"  # the call the calculator task's system prompt teaches (rollout.agent.format=tag)


def _plain_final_answer(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """The calculator task: the last number of the model's final turn, when the loop ended because
    the model answered (a tool's answer before it, or a call holding the number, does not count)."""
    info = extra_info or {}
    ended_by = info.get("ended_by")
    final = info.get("final_text") if ended_by is not None else solution_str
    return plain_answer_score(final if isinstance(final, str) else "", ground_truth, ended_by, CALCULATOR_CALL)


_gsm8k.__qualname__ = _gsm8k.__name__ = "gsm8k_strict"
_plain_final_answer.__qualname__ = _plain_final_answer.__name__ = "plain_final_answer"
_dapo = _named("math_dapo", dapo_score)

BUILTIN_SCORERS: dict[str, Scorer] = {
    "openai/gsm8k": _gsm8k,
    "gsm8k": _gsm8k,
    "arithmetic": _named("last_number", last_number_score),
    "shapes": _named("last_number", last_number_score),  # offstep.data.shapes_task
    "calculator": _plain_final_answer,
    **dict.fromkeys(MATH_LIGHTEVAL_SOURCES, _named("math_lighteval", lighteval_math_score)),
    **dict.fromkeys(DAPO_SOURCES, _dapo),
    **dict.fromkeys(NUMINA_SOURCES, _named("prime_math", prime_math_score)),
    "hiyouga/geometry3k": _named("geo3k", geo3k_score),
    **dict.fromkeys(SEARCH_R1_SOURCES, _named("search_r1_em", search_r1_em_score)),
    **dict.fromkeys((*CODE_SOURCES, CODE_TASK), _named("prime_code", code_score)),
}


def builtin_scorer(data_source: str) -> Scorer | None:
    """The built-in scorer of ``data_source`` (exact names, ``aime*`` as verl routes it, and
    ``reasoning_gym/<dataset>``: that dataset's own verifier), or None."""
    fn = BUILTIN_SCORERS.get(data_source)
    if fn is None and isinstance(data_source, str) and data_source.startswith(DAPO_PREFIX):
        return _dapo
    if fn is None and isinstance(data_source, str) and data_source.startswith(REASONING_GYM):
        return reasoning_gym_score
    return fn


def builtin_names() -> list[str]:
    """The data sources with a built-in scorer, for messages."""
    return sorted(BUILTIN_SCORERS) + [f"{DAPO_PREFIX}*", f"{REASONING_GYM}*"]


def unscored_sources(
    data_sources: Iterable[str],
    custom_path: str | None = None,
    path_key: str = "reward.custom_path",
    name_key: str = "reward.custom_name",
) -> list[str]:
    """One message per data source that nothing would score (none when ``custom_path`` is set: the
    custom scorer takes every source), each naming the source and the fix."""
    if custom_path:
        return []
    missing = sorted({str(s) for s in data_sources if builtin_scorer(str(s)) is None})
    return [
        f"data source {s!r} has no built-in reward scorer (built-in: {', '.join(builtin_names())}). Fix: set {path_key}=/path/to/scorer.py with a function {name_key}=compute_score"
        f"(data_source, solution_str, ground_truth, extra_info=None), or relabel the data_source column"
        for s in missing
    ]
