"""Final answers of math responses: ``\\boxed{}`` extraction and the string normalisations that
verl's math scorers compare with (pure functions, no I/O).

* ``hendrycks_strip``: the MATH dataset's answer normalisation (Hendrycks et al. 2021, "Measuring
  Mathematical Problem Solving With the MATH Dataset", its ``is_equiv``), used by verl's
  ``math_reward`` (the lighteval MATH sources) and by the PRM800K grader (``math_grade``).
* ``minerva_normalize``: the final-answer normalisation of Minerva (Lewkowycz et al. 2022,
  arXiv:2206.14858, appendix D.1), used by verl's ``math_dapo``.
* ``lighteval_math_score`` and ``dapo_score``: verl's scores for those sources.
"""

from __future__ import annotations

import re


def brace_span(text: str, start: int) -> tuple[int, int] | None:
    """``(first "{", its matching "}")`` at or after ``start``, or None when the braces never close."""
    depth, first = 0, None
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            first = i if first is None else first
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return (i if first is None else first), i
    return None


def boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (braces matched), or None: verl's ``math_dapo``
    extraction (only the ``\\boxed{`` form)."""
    at = text.rfind("\\boxed{")
    span = brace_span(text, at) if at >= 0 else None
    return None if span is None else text[span[0] + 1 : span[1]]


def lighteval_boxed_answer(text: str) -> str | None:
    """The answer verl's ``math_reward`` reads: after the last ``"\\boxed "`` up to a ``$`` if the
    text has that spaced form anywhere, else the content of the last ``\\boxed{...}``. None when
    there is none (an ``\\fbox{}`` alone does not count)."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    at = text.rfind("\\boxed")
    span = brace_span(text, at) if at >= 0 else None
    if span is None or span[0] != at + len("\\boxed"):  # "\boxedx{..}" or an unclosed box
        return None
    return text[span[0] + 1 : span[1]]


# --------------------------------------------------------------------------------------------------
# Hendrycks' MATH normalisation


def _braced_fracs(s: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``; unchanged when a
    ``\\frac`` is followed by one character; IndexError when by none (as the original)."""
    head, *parts = s.split("\\frac")
    out = [head]
    for part in parts:
        out.append("\\frac")
        if not part:
            raise IndexError("\\frac at the end")
        if part.startswith("{"):
            out.append(part)
            continue
        if len(part) < 2:
            return s
        a, b, rest = part[0], part[1], part[2:]
        out.append(f"{{{a}}}{{{b}}}{rest}" if b != "{" else f"{{{a}}}{b}{rest}")
    return "".join(out)


def _slash_to_frac(s: str) -> str:
    """``"3/4"`` (two plain integers) -> ``\\frac{3}{4}``."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        a, b = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{a}}}{{{b}}}" if s == f"{a}/{b}" else s


def _braced_sqrt(s: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}``. Raises IndexError on a trailing ``\\sqrt`` (the caller falls
    back to comparing the raw strings, as the original does)."""
    if "\\sqrt" not in s:
        return s
    head, *parts = s.split("\\sqrt")
    return head + "".join("\\sqrt" + (p if p[0] == "{" else "{" + p[0] + "}" + p[1:]) for p in parts)


def hendrycks_strip(s: str, plain_percent: bool = False) -> str:
    """The MATH answer normalisation. ``plain_percent``: also drop a bare ``%`` (MathRuler's
    variant, which verl's geo3k scorer uses). Raises ValueError or IndexError on the inputs where
    the original asserts (the callers then compare the raw strings)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    if "\\text{ " in s:  # a unit on the right
        pieces = s.split("\\text{ ")
        if len(pieces) != 2:
            raise ValueError("more than one '\\text{ '")
        s = pieces[0]
    if plain_percent:
        s = s.replace("\\%", "").replace("%", "")
    else:
        s = s.replace("\\\\%", "").replace("\\%", "")
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> "5"
        s = sides[1]
    s = _braced_sqrt(s).replace(" ", "")
    s = _braced_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_to_frac(s)


def hendrycks_equal(a: str, b: str) -> bool:
    """MATH's ``is_equiv``: equal after ``hendrycks_strip``, or as raw strings where it fails."""
    try:
        return hendrycks_strip(a) == hendrycks_strip(b)
    except (ValueError, IndexError):
        return a == b


def lighteval_math_score(solution_str: str, ground_truth) -> float:
    """verl's score for the MATH sources (``lighteval/MATH`` and its copies): 1.0 if the last boxed
    answer equals the ground truth after ``hendrycks_strip``, else 0.0 (no format score)."""
    answer = lighteval_boxed_answer(solution_str)
    return 1.0 if answer is not None and hendrycks_equal(answer, str(ground_truth)) else 0.0


# --------------------------------------------------------------------------------------------------
# Minerva's normalisation (verl's math_dapo)

# (before, after) replacements, then removed words and LaTeX, in this order (Minerva's lists)
_MINERVA_SUBSTITUTIONS = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
_MINERVA_REMOVED = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)
MINERVA_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
INVALID = "[INVALID]"


def minerva_normalize(answer: str) -> str:
    """Minerva's normalisation of a final answer: the last side of an equation, units and filler
    words dropped, ``\\text{}``/``\\boxed{}`` unwrapped, ``\\frac12``/``\\sqrt2`` braced, a
    comma-grouped integer without its commas."""
    answer = answer.split("=")[-1]
    for before, after in _MINERVA_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for removed in _MINERVA_REMOVED:
        answer = answer.replace(removed, "")
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", answer)  # the first $...$ only
    for macro in ("text", "textbf", "overline"):
        answer = re.sub(r"(\\" + macro + r"\{)(.*?)(\})", r"\2", answer)
    answer = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", answer)
    answer = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", answer)
    answer = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def dapo_score(solution_str: str, ground_truth) -> dict:
    """verl's ``math_dapo`` score (DAPO, Yu et al. 2025, arXiv:2503.14476): in the last 300
    characters, the text after the last ``Answer:`` (to the end of its line), normalised by
    ``minerva_normalize``, against the normalised ground truth. ``{"score": 1.0 or -1.0, "acc":
    True or False, "pred": the normalised answer, "[INVALID]" when there is none}``."""
    tail = solution_str[-300:]
    found = MINERVA_ANSWER.findall(tail)
    pred = minerva_normalize(found[-1] if found else INVALID)
    correct = pred == minerva_normalize(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
