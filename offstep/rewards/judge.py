"""A generative judge's text as a score, and its prompt (``reward.model.kind=generative``).

Pure string work, no model: the judge itself runs in ``offstep.rollout.scoring.replica_reward_model``. A parser
returns None when the text holds no score it accepts; the caller gives that sample the fallback
score and counts it.
"""

from __future__ import annotations

import math
import re
import string

from offstep.config.choices import JUDGE_PARSERS, JUDGE_TEMPLATES
from offstep.rewards.scorers import last_number

TEMPLATE_FIELDS = ("question", "response", "ground_truth")
REGEX_PREFIX = "regex:"
_YES_NO = re.compile(r"\b(yes|no)\b", re.IGNORECASE)
_ASKED = "Question: {question}\nReference answer: {ground_truth}\nResponse: {response}\n"
TEMPLATES = {  # reward.model.template by name; each goes with the parser of the same kind
    "score": _ASKED + "Is the response correct? Answer with a score between 0 and 1.",  # parser=last_number
    "yes_no": _ASKED + "Does the response give the reference answer? Answer yes or no.",  # parser=yes_no
}
assert tuple(TEMPLATES) == JUDGE_TEMPLATES


def template_text(template: str) -> str:
    """The judge prompt that ``reward.model.template`` means: a named template's text, or itself."""
    return TEMPLATES.get(template, template)


def parser_problem(parser: str) -> str | None:
    """Why ``parser`` (``reward.model.parser``) cannot be used, or None."""
    if parser in JUDGE_PARSERS:
        return None
    if not isinstance(parser, str) or not parser.startswith(REGEX_PREFIX):
        return (
            f"reward.model.parser={parser!r} is not one of {list(JUDGE_PARSERS)} nor regex:PATTERN; e.g. "
            f"reward.model.parser=last_number, or 'reward.model.parser=regex:Score: ([0-9.]+)'"
        )
    try:
        groups = re.compile(parser[len(REGEX_PREFIX) :]).groups
    except re.error as exc:
        return f"reward.model.parser={parser!r} is not a valid regular expression ({exc}); fix the pattern"
    if groups < 1:
        return (
            f"reward.model.parser={parser!r} has no group: the score is the first match's first group, so put "
            f"it in parentheses, e.g. 'regex:Score: ([0-9.]+)'"
        )
    return None


def template_problem(template: str) -> str | None:
    """Why the judge prompt ``template`` (``reward.model.template``) cannot be rendered, or None."""
    template = template_text(template)
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        return (
            f"reward.model.template cannot be formatted ({exc}); write the fields as {{question}}, {{response}}, "
            f"{{ground_truth}} and a literal brace as {{{{ or }}}}"
        )
    unknown = sorted(names - set(TEMPLATE_FIELDS))
    if unknown:
        return (
            f"reward.model.template names {unknown}, which are not fields of a sample; use only "
            f"{{question}}, {{response}} and {{ground_truth}} (a literal brace is written {{{{ or }}}})"
        )
    if "response" not in names:
        return (
            f"reward.model.template={template!r} is not one of the named templates {list(JUDGE_TEMPLATES)} and has "
            f"no {{response}}: the judge would not see what it judges; name one, or add {{response}} to yours"
        )
    return None


def render_judge_prompt(template: str, question: str, response: str, ground_truth) -> str:
    """The judge's user turn for one sample (``template``: a name in TEMPLATES or a template)."""
    return template_text(template).format(question=question, response=response, ground_truth=ground_truth)


def parse_score(text: str, parser: str) -> float | None:
    """The score the judge's ``text`` gives under ``parser``, or None if it gives none.

    ``last_number``: the last number in the text, accepted only in [0, 1] (``"0.8"`` -> 0.8,
    ``"7 of 10"`` -> None: 10 is out of range). ``yes_no``: the first whole word yes / no, any case
    (``"Yes."`` -> 1.0). ``regex:PATTERN``: the first match's first group, read as a number.
    """
    if parser == "last_number":
        value = last_number(text)
        return value if value is not None and 0.0 <= value <= 1.0 else None
    if parser == "yes_no":
        found = _YES_NO.search(text)
        return None if found is None else float(found.group(1).lower() == "yes")
    if parser.startswith(REGEX_PREFIX):
        found = re.search(parser[len(REGEX_PREFIX) :], text)
        if found is None or found.group(1) is None:
            return None
        try:
            value = float(found.group(1).strip())
        except ValueError:
            return None
        return value if math.isfinite(value) else None
    raise ValueError(parser_problem(parser))
