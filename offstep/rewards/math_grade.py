"""Math answer equivalence with sympy: the PRM800K grader (Lightman et al. 2023, "Let's Verify Step
by Step", arXiv:2305.20050, its ``grade_answer``) and the PRIME verifier's numeric/symbolic
fallback, as verl's ``prime_math`` (the ``numina_*`` sources) and ``geo3k`` scorers use them.

Departures, for safety: sympy parses a candidate only when it is made of numbers, operators,
brackets, single letters and a few function names (verl's fallback hands any string to Python's
``eval``), and exponent towers are never evaluated (verl stops them with a timer). LaTeX is read by
``latex_to_text`` below (pylatexenc's conversion is not a dependency), which writes the macros
these answers use as pylatexenc does; verl's environment cannot parse LaTeX with sympy (its antlr
is too old), so neither does this module.
"""

from __future__ import annotations

import math
import re

from offstep.rewards.math_answers import boxed_answer, brace_span, hendrycks_strip

# --------------------------------------------------------------------------------------------------
# LaTeX to plain text

_SYMBOLS = {
    "pi": "pi",
    "infty": "inf",
    "cup": "U",
    "cdot": "*",
    "times": "*",
    "div": "÷",
    "pm": "±",
    "mp": "∓",
    "le": "≤",
    "leq": "≤",
    "ge": "≥",
    "geq": "≥",
    "ne": "≠",
    "neq": "≠",
    "circ": "∘",
    "degree": "°",
    "alpha": "α",
    "beta": "β",
    "gamma": "γ",
    "delta": "δ",
    "theta": "θ",
    "lambda": "λ",
    "mu": "μ",
    "sigma": "σ",
    "phi": "φ",
    "omega": "ω",
    "ldots": "...",
    "dots": "...",
    "cdots": "⋯",
}
_SPACES = {",": " ", ";": " ", ":": " ", " ": " ", "!": "", "quad": " ", "qquad": " "}
_MACRO = re.compile(r"\\([A-Za-z]+|.)")


def _group(s: str, i: int) -> tuple[str, int]:
    """The argument at ``s[i:]`` (spaces skipped): a braced group's content or one character."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i < len(s) and s[i] == "{":
        span = brace_span(s, i)
        end = span[1] if span else len(s)
        return s[i + 1 : end], end + 1
    if i < len(s) and s[i] == "\\":
        m = _MACRO.match(s, i)
        return m.group(0), m.end()
    return s[i : i + 1], i + 1


def latex_to_text(s: str) -> str:
    """``s`` as text, as pylatexenc's ``LatexNodes2Text`` writes it, with verl's replacements:
    ``\\frac{a}{b}`` -> ``a/b`` (no brackets), ``\\sqrt{x}`` -> ``sqrt(x)`` (a root's degree is
    dropped), ``\\pi`` -> ``pi``, ``\\cdot`` and ``\\times`` -> ``*``, ``\\infty`` -> ``inf``;
    braces dropped, other macros (``\\text``, ``\\left``, ...) leave their arguments."""
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c in "{}":
            i += 1
            continue
        if c != "\\":
            out.append(c)
            i += 1
            continue
        m = _MACRO.match(s, i)
        name, i = m.group(1), m.end()
        if name.isalpha():  # TeX drops the spaces after a control word
            while i < len(s) and s[i] == " ":
                i += 1
        if name in ("frac", "dfrac", "tfrac"):
            num, i = _group(s, i)
            den, i = _group(s, i)
            out.append(f"{latex_to_text(num)}/{latex_to_text(den)}")
        elif name == "sqrt":
            if i < len(s) and s[i] == "[":
                close = s.find("]", i)
                i = len(s) if close < 0 else close + 1
            arg, i = _group(s, i)
            out.append(f"sqrt({latex_to_text(arg)})")
        elif name in _SYMBOLS:
            out.append(_SYMBOLS[name])
        elif name in _SPACES:
            out.append(_SPACES[name])
        elif not name.isalpha():
            out.append(name)  # \% \$ \{ ...
    return "".join(out)


# --------------------------------------------------------------------------------------------------
# safe sympy


_SAFE_CHARS = re.compile(r"[0-9A-Za-z\s.+\-*/^(),\[\]]*")
_NAMES = {"sqrt", "pi", "exp", "log", "ln", "sin", "cos", "tan", "oo", "E", "I"}
_TOWER = re.compile(r"(\^|\*\*)\s*\(?\s*[0-9]{3,}|(\^|\*\*)[^+\-*/()]*(\^|\*\*)")


def _sympy_ok(expr: str, check_names: bool = True) -> bool:
    """Whether sympy may evaluate ``expr``: only numbers, operators, brackets and names of one or
    two letters or in ``_NAMES`` (``check_names=False``: any name; the caller allows at most two
    distinct letters), and no exponent tower or exponent of 3 digits or more."""
    if len(expr) > 500 or not _SAFE_CHARS.fullmatch(expr) or _TOWER.search(expr):
        return False
    return not check_names or all(len(w) <= 2 or w in _NAMES for w in re.findall(r"[A-Za-z_]+", expr))


def _parse(expr: str, implicit: bool):
    from sympy.parsing import sympy_parser as sp

    transforms = sp.standard_transformations + ((sp.implicit_multiplication_application,) if implicit else ())
    return sp.parse_expr(expr, transformations=transforms)


# --------------------------------------------------------------------------------------------------
# PRM800K's grade_answer


def mathd_normalize(answer: str, plain_percent: bool = False) -> str:
    """PRM800K's ``math_normalize``: strip, unwrap a whole ``\\text{...}``, ``hendrycks_strip``
    (the answer as it stands where that fails)."""
    answer = answer.strip()
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", answer)
    if m is not None:
        answer = m.group("text").strip()
    try:
        return hendrycks_strip(answer, plain_percent)
    except (ValueError, IndexError):
        return answer


_UNITS = (
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
    "liter",
)


def _is_int_value(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):
        return False


def _strip_thousands(expr: str) -> str:
    """``1,234,567`` -> ``1234567``, leaving tuple commas (``1,2``) alone."""
    while True:
        new = re.sub(r"(\d)(,)(\d\d\d)($|\D)", r"\1\3\4", expr)
        if new == expr:
            return new
        expr = new


def _str_is_int(x: str) -> bool:
    try:
        return _is_int_value(float(_strip_thousands(x)))
    except ValueError:
        return False


def _is_frac(expr: str) -> bool:
    return bool(re.search(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$", expr))


def grader_normalize(expr: str, mathruler: bool = False) -> str:
    """PRM800K's ``_normalize``: units, ``$``/``%``, ``million``... dropped, LaTeX to text, lower
    case, integers canonical. ``mathruler``: MathRuler's variant (verl's geo3k): no ``liter``, and
    spaces and leftover braces removed."""
    m = re.search(r"^\\text\{(?P<text>.+?)\}$", expr)
    if m is not None:
        expr = m.group("text")
    for before, after in (
        ("\\%", "%"),
        ("\\$", "$"),
        ("$", ""),
        ("%", ""),
        (" or ", " , "),
        (" and ", " , "),
        ("million", "*10^6"),
        ("billion", "*10^9"),
        ("trillion", "*10^12"),
    ):
        expr = expr.replace(before, after)
    for unit in _UNITS[:-1] if mathruler else _UNITS:
        expr = re.sub(unit + r"(es)?(s)? *(\^[0-9]+)?", "", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    try:
        if _is_int_value(float(expr)):
            expr = str(int(round(float(expr))))
    except ValueError:
        pass
    if "\\" in expr:
        expr = latex_to_text(
            expr.replace("\\frac", " \\frac").replace("\\dfrac", " \\frac").replace("\\tfrac", " \\frac")
        ).strip()
    expr = re.sub("- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number: 7 3/4 -> 7+3/4
    if mathruler:
        expr = expr.replace(" ", "").replace("{", "").replace("}", "")
    expr = expr.lower()
    if _str_is_int(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _letters(expr: str) -> int:
    return len({c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()})


def _sympy_equal(truth: str, given: str) -> bool:
    """PRM800K: ``simplify(truth - given) == 0``, for expressions of at most two unknowns."""
    expr = f"({truth})-({given})"
    if _letters(expr) > 2 or "^{" in expr or "^(" in expr or re.search(r"\^[0-9]+\^|\^[0-9][0-9]+", expr):
        return False
    if not _sympy_ok(expr, check_names=False):
        return False
    import sympy

    try:
        return sympy.simplify(_parse(expr.replace("^", "**"), implicit=True)) == 0
    except Exception:  # noqa: BLE001 - sympy raises many kinds on text it cannot read
        return False


def _split_tuple(expr: str) -> list[str]:
    expr = _strip_thousands(expr)
    if not expr:
        return []
    brackets = "()[]"
    if len(expr) > 2 and expr[0] in brackets and expr[-1] in brackets and not any(c in expr[1:-1] for c in brackets):
        return [e.strip() for e in expr[1:-1].split(",")]
    return [expr]


def grade_answer(given: str | None, truth: str, mathruler: bool = False) -> bool:
    """PRM800K's grader: equal after ``mathd_normalize``, or after ``grader_normalize``, or element
    by element (tuples and intervals with the same brackets) where an unreduced fraction must match
    exactly, an integer only an integer, and the rest must simplify to the same value in sympy."""
    if given is None:
        return False
    if mathd_normalize(truth, mathruler) == mathd_normalize(given, mathruler):
        return True
    truth_n, given_n = grader_normalize(truth, mathruler), grader_normalize(given, mathruler)
    if truth_n == given_n:
        return True
    if not given_n:
        return False
    truth_parts, given_parts = _split_tuple(truth_n), _split_tuple(given_n)
    if len(truth_parts) != len(given_parts):
        return False
    if len(truth_parts) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False
    for t, g in zip(truth_parts, given_parts):
        if _is_frac(t) and _is_frac(g):
            ok = t == g
        elif _str_is_int(t) != _str_is_int(g):
            ok = False
        else:
            ok = _sympy_equal(t, g)
        if not ok:
            return False
    return True


# --------------------------------------------------------------------------------------------------
# the PRIME verifier (verl's prime_math) and geo3k


def prime_answer(response: str) -> str:
    """The answer PRIME's ``match_answer`` reads from a response: the text after the last "answer
    is"/"answer:", before "is the answer", the last ``\\boxed{}``/``\\fbox{}`` content, then before
    the last ". " and after the last "is "/"="/": "... (the whole response if none of these)."""
    for marker in ("answer:", "answer is", "answers are"):
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[at + len(marker) :].strip()
    for marker in ("is answer", "is the answer", "are answers", "are the answers"):
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[:at].strip()
    at = response.rfind("\\boxed")
    at = response.rfind("\\fbox") if at < 0 else at
    span = brace_span(response, at) if at >= 0 else None
    if span is not None and response[span[0] + 1 : span[1]].strip():
        response = response[span[0] + 1 : span[1]].strip()
    if ". " in response:
        response = response[: response.lower().rfind(". ")].strip()
    for marker in ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n"):
        at = response.lower().rfind(marker)
        if at != -1:
            response = response[at + len(marker) :].strip()
    return response


def _arith(expr: str) -> float | None:
    """The value of an expression of numbers, ``+ - * / **`` and brackets, or None (no ``eval``)."""
    import ast
    import operator

    ops = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.Pow: operator.pow,
        ast.USub: operator.neg,
        ast.UAdd: operator.pos,
    }

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return ops[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    try:
        return float(value(ast.parse(expr, mode="eval").body))
    except (SyntaxError, ValueError, TypeError, ZeroDivisionError, OverflowError, RecursionError):
        return None


def _prime_normalize(x: str, pi: float):
    """PRIME's ``normalize``: ``$5`` -> ``5``, ``5%`` -> ``5``, ``101_2`` -> the int 101 (its base
    dropped; ValueError where the part before ``_`` is not a number), ``\\pi`` -> ``pi`` evaluated
    where the result is arithmetic."""
    if re.match(r"\$\d+(\.\d+)?", x):
        return x[1:]
    if re.match(r"^\d+(\.\d+)?%$", x) or re.match(r"^\d+(\.\d+)?\\%$", x):
        return x.replace("\\%", "").replace("%", "")
    if "_" in x:
        return int(float(x.split("_")[0]))
    if "\\pi" in x:
        x = re.sub(r"(?<=\d)\\pi", f"*{pi}", x).replace("\\pi", f"1*{pi}")
        value = _arith(x)
        return x if value is None else value
    return x


def _number(x) -> float | None:
    text = str(x)
    try:
        return float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return None


def _symbolic_equal(a: str, b: str, tol: float) -> bool:
    import sympy

    def parse(s):
        if isinstance(s, str) and _sympy_ok(s):
            try:
                return _parse(s, implicit=False)
            except Exception:  # noqa: BLE001 - sympy raises many kinds on text it cannot read
                return None
        return None

    x, y = parse(a), parse(b)
    if x is None or y is None:
        return False
    try:
        if sympy.simplify(x - y) == 0:
            return True
    except Exception:  # noqa: BLE001
        pass
    try:
        return math.isclose(float(sympy.N(x)), float(sympy.N(y)), rel_tol=tol)
    except Exception:  # noqa: BLE001 - not a number (a free symbol, a complex value)
        return False


def math_equal(pred, ref, tol: float = 1e-4, pi: float = math.pi) -> bool:
    """PRIME's ``math_equal``: equal as text; or both numbers within ``tol`` (relative), the truth
    also read as a percentage (x/100, x*100); or, bracket by bracket and comma by comma, equal
    parts; or equal in sympy. Raises ValueError on a ``_`` answer that is not a number (PRIME's
    scorer then counts the answer as wrong)."""
    pred, ref = _prime_normalize(pred, pi), _prime_normalize(ref, pi)
    if isinstance(pred, str):
        pred = pred[:1000]
    if isinstance(pred, str) and isinstance(ref, str):
        if pred.strip().lower() == ref.strip().lower() or pred.replace(" ", "") == ref.replace(" ", ""):
            return True
    p_num, r_num = _number(pred), _number(ref)
    if p_num is not None and r_num is not None:
        return any(math.isclose(c, p_num, rel_tol=tol) for c in (r_num / 100, r_num, r_num * 100))
    if not pred and pred not in (0, False):
        return False
    ref, pred = str(ref).strip(), str(pred).strip()
    p, r = pred, ref
    if (p[:1] == "[" and p[-1:] == "]" and not r.startswith("(")) or (
        p[:1] == "(" and p[-1:] == ")" and not r.startswith("[")
    ):
        p, r = p.strip("[]()"), r.strip("[]()")
    if re.sub(r"[{}()]", "", p) == re.sub(r"[{}()]", "", r):
        return True
    if pred and ref and pred[0] in "([" and pred[-1] in ")]" and (pred[0], pred[-1]) == (ref[0], ref[-1]):
        p_parts, r_parts = pred[1:-1].split(","), ref[1:-1].split(",")
        if len(p_parts) == len(r_parts) and all(math_equal(a, b, tol) for a, b in zip(p_parts, r_parts)):
            return True
    if "," in pred and "," in ref:
        p_parts, r_parts = [s.strip() for s in pred.split(",")], [s.strip() for s in ref.split(",")]
        if len(p_parts) == len(r_parts):
            return all(math_equal(a, b, tol) for a, b in zip(p_parts, r_parts))
    return _symbolic_equal(pred, ref, tol)


def prime_math_score(solution_str: str, ground_truth) -> float:
    """verl's score for the ``numina_*`` sources (PRIME, Cui et al. 2025, arXiv:2502.01456): 1.0
    if ``prime_answer`` of the response grades equal to the ground truth (``grade_answer``, then
    ``math_equal``; with ``\\pi``, pi read as 3.14159... or 3.14), else 0.0."""
    answer, truth = prime_answer(str(solution_str)), str(ground_truth)
    if grade_answer(answer, truth):
        return 1.0
    try:
        if "\\pi" in answer or "\\pi" in truth:
            return float(any([math_equal(answer, truth, pi=p) for p in (math.pi, 3.14)]))
        return float(math_equal(answer, truth))
    except (ValueError, OverflowError):
        return 0.0


_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def geo3k_score(solution_str: str, ground_truth, format_score: float = 0.1) -> float:
    """verl's ``geo3k`` score: ``(1 - format_score) * accuracy + format_score * format``, accuracy
    by MathRuler's ``grade_answer`` of the last ``\\boxed{}`` content, format 1 when the response is
    ``<think>...</think>...\\boxed{...}...``."""
    answer = boxed_answer(solution_str)
    acc = grade_answer("None" if answer is None else answer.strip(), str(ground_truth), mathruler=True)
    fmt = _GEO3K_FORMAT.fullmatch(solution_str) is not None
    return (1.0 - format_score) * float(acc) + format_score * float(fmt)
