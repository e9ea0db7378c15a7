"""Pure rule-based scorers (no model, no I/O).

``gsm8k_score`` follows verl's GSM8K rule: only the last 300 characters of the response are
searched; ``"strict"`` takes the number after the last ``"#### "``, ``"flexible"`` the last number
anywhere; the extracted answer is compared to the ground truth as a *string* (so ``"72.0"`` does
not match ``"72"``). No extractable answer scores 0, a wrong answer ``format_score``, a right one
``score``.
"""

from __future__ import annotations

import math
import re
import string

SOLUTION_CLIP_CHARS = 300

_STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE_RE = re.compile(r"(\-?[0-9\.\,]+)")

_NUMBER_RE = re.compile(
    r"(?:(?<![\w.])[-\u2212])?"  # a sign, unless glued to a word or number ("5-3" is 5 and 3)
    r"(?<![\d.])"  # start at the beginning of a number
    r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"  # digits, optionally with thousands commas
    r"(?:\.\d+)?"  # decimal part
)


def _clean(answer: str) -> str:
    return answer.replace(",", "").replace("$", "")


def extract_gsm8k_answer(solution_str: str, method: str = "strict") -> str | None:
    """The answer string verl's GSM8K rule extracts from ``solution_str``, or None."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    if len(solution_str) > SOLUTION_CLIP_CHARS:
        solution_str = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT_RE.findall(solution_str)
        return _clean(found[-1]) if found else None
    for candidate in reversed(_FLEXIBLE_RE.findall(solution_str)):
        candidate = _clean(candidate)
        if candidate not in ("", ".", "-", "-."):
            return candidate
    return None


def gsm8k_score(
    solution_str: str,
    ground_truth,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """verl's GSM8K score: ``score`` if the extracted answer equals the ground truth, ``format_score``
    if an answer was extracted but differs, else 0.0."""
    answer = extract_gsm8k_answer(solution_str, method=method)
    if answer is None:
        return 0.0
    truth = _clean(str(ground_truth).strip())
    return float(score) if answer == truth else float(format_score)


def _parse_number(text: str) -> float | None:
    text = text.strip().replace(",", "").replace("$", "").replace("\u2212", "-")
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def last_number(solution_str: str) -> float | None:
    """The last number in ``solution_str`` (negatives, thousands commas, decimals), or None."""
    found = _NUMBER_RE.findall(solution_str)
    if not found:
        return None
    return _parse_number(found[-1])


def last_number_score(solution_str: str, ground_truth) -> float:
    """1.0 if the last number in the text equals the ground truth numerically, else 0.0.

    ``"12.0"`` equals ``"12"``, ``"1,234"`` equals ``1234``, ``"-7"`` equals ``-7``.
    """
    predicted = last_number(solution_str)
    if predicted is None:
        return 0.0
    if isinstance(ground_truth, bool):
        return 0.0
    if isinstance(ground_truth, (int, float)):
        truth = float(ground_truth)
    else:
        truth = _parse_number(str(ground_truth))
    if truth is None or not math.isfinite(truth):
        return 0.0
    return 1.0 if math.isclose(predicted, truth, rel_tol=1e-9, abs_tol=1e-9) else 0.0


def plain_answer_score(final_turn: str, ground_truth, ended_by: str | None, call_marker: str) -> float:
    """A tool task's score: ``last_number_score`` of the model's final turn, counted only when that
    turn is a plain answer, else 0.0.

    ``ended_by`` is why the tool loop ended (``offstep.rollout.agents.agent_loop``): only ``"answer"`` (a
    turn without a call) counts; ``"budget"`` (the token budget ran out, e.g. inside a call) and
    ``"max_turns"`` (a call that was never run) score 0, whatever number they hold. ``None``: the
    row was answered in one turn, without a loop (the no-tool baseline); it counts unless it
    contains ``call_marker``, a call that nothing ran.
    """
    if ended_by is None:
        answered = call_marker not in final_turn
    else:
        answered = ended_by == "answer"
    return last_number_score(final_turn, ground_truth) if answered else 0.0


def qa_normalize(text: str) -> str:
    """SQuAD's answer normalisation (Rajpurkar et al. 2016): lower case, punctuation and the
    articles a/an/the removed, whitespace collapsed."""
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def search_r1_em_score(solution_str: str, ground_truth, format_score: float = 0.0, score: float = 1.0) -> float:
    """verl's Search-R1 exact match (Jin et al. 2025, arXiv:2503.09516): the last
    ``<answer>...</answer>`` against ``ground_truth["target"]`` (one string or a list), both
    ``qa_normalize`` d. No answer: 0; a wrong one: ``format_score``; a right one ``score``, a
    quarter of it when the response has more than 10 opening or closing answer tags."""
    found = _ANSWER_TAG.findall(solution_str)
    if not found:
        return 0.0
    targets = ground_truth["target"] if isinstance(ground_truth, dict) else ground_truth
    targets = [targets] if isinstance(targets, str) else list(targets)
    answer = qa_normalize(found[-1].strip())
    if not any(qa_normalize(str(t)) == answer for t in targets):
        return float(format_score)
    spam = solution_str.count("<answer>") > 10 or solution_str.count("</answer>") > 10
    return float(score) / 4 if spam else float(score)
