"""verl's code rewards (``prime_code``, for codecontests, apps, codeforces and taco): the model's
program run against the tests of ``reward_model.ground_truth`` in ``offstep.sandbox``.

The ground truth is a dict (or its JSON) with ``inputs`` and ``outputs``, one entry per test:
stdin/stdout tests, or, with ``fn_name``, call tests (each input line is one JSON argument, the
output one JSON value; with a ``class Solution`` in the program, its method is called). The
program is what follows the last ```` ```python```` of the response, up to the next fence (the
whole response when there is none), as verl takes it.

Scores as verl's ``default_compute_score`` does for these sources (``continuous=True``): 1.0 when
every test passes, else the share passing among the first ten (which is the same number: verl
tries all tests first, then scores the first ten one by one). Each test runs in its own sandbox
and is judged outside it (a program cannot forge its verdict), with verl's rules: stdout matched
as whole text, as stripped lines, as numbers within ``1e-5`` relative, call results by equality;
the program sees verl's star imports of the standard library first. Where offstep departs, on
purpose: after a test times out, the later ones count as failed without running (verl waits out
each); no tests at all score 1.0 if the program loads, as in verl.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from offstep.sandbox import Result, shared

SCORED_TESTS = 10  # verl scores the first ten tests of a failing program
_MODULES = (
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
)
# What verl puts before the program: star imports (builtins last, so that io's open is not the one seen),
# the modules themselves, and a deep recursion limit.
PREAMBLE = (
    "".join(f"from {m} import *\n" for m in (*_MODULES, "builtins", "typing"))
    + "".join(f"import {m}\n" for m in _MODULES)
    + "sys.setrecursionlimit(6*10**5)\n"
)
_MARK = "\x00offstep-call-result\x00"

# Runs the program (``SRC``) as __main__ after the preamble. stdin mode: its stdout is the output, and
# sys.exit() ends it cleanly (verl catches SystemExit). call mode: its prints are dropped, the function
# (or Solution's method) is called with the JSON arguments, and the result comes back as a literal.
_HARNESS = (
    PREAMBLE
    + '''
import builtins as _b, io as _io, json as _json, sys as _sys
_src, _mode, _fn, _args = {src!r}, {mode!r}, {fn!r}, {args!r}
try:
    if _mode == "call":
        _sys.stdout = _io.StringIO()
    exec(compile(_src, "<solution>", "exec"), globals())
except SystemExit:
    if _mode == "call":
        raise
if _mode == "call":
    _target = globals()["Solution"]() if "class Solution" in _src else globals()
    _method = getattr(_target, _fn) if "class Solution" in _src else _target[_fn]
    _argv = [_json.loads(line) for line in _args.split("\\n")]
    try:
        if isinstance(_argv[0], dict):
            _argv = [{{int(k): v for k, v in _argv[0].items()}}]
    except Exception:
        pass
    _out = _method(*_argv)
    _json.dumps(_out)
    _sys.__stdout__.write({mark!r} + repr(_out))
'''
)


def extract_code(response: str) -> str:
    """The program of a response: after its last ```` ```python````, up to the next fence."""
    tail = response.rsplit("```python", 1)[-1]
    return tail.split("```", 1)[0]


def _tests(ground_truth: Any) -> dict | None:
    if isinstance(ground_truth, (str, bytes)):
        try:
            ground_truth = json.loads(ground_truth)
        except ValueError:
            return None
    if (
        not isinstance(ground_truth, dict)
        or not isinstance(ground_truth.get("inputs"), list)
        or not isinstance(ground_truth.get("outputs"), list)
    ):
        return None
    return ground_truth


def _lines_close(out: list[str], expected: list[str]) -> bool:
    """verl's numeric comparison: the same number of lines, not all whole numbers, each a float within
    numpy's allclose (1e-5 relative, 1e-8 absolute) of the expected one."""
    if len(out) != len(expected) or all(a.isdigit() and b.isdigit() for a, b in zip(out, expected)):
        return False
    try:
        pairs = [(float(a), float(b)) for a, b in zip(out, expected)]
    except ValueError:
        return False
    return all(a == b or abs(a - b) <= 1e-8 + 1e-5 * abs(b) for a, b in pairs)


def stdout_matches(stdout: str, expected: Any) -> bool:
    """Whether a program's stdout passes a stdin/stdout test, by verl's rules (in their order)."""
    exp = "\n".join(expected) if isinstance(expected, list) else str(expected)
    lines = stdout.splitlines()
    if "\n".join(lines).strip() == exp.strip() or "\n".join(x.strip() for x in lines).strip() == exp.strip():
        return True
    exp_lines = [x.strip() for x in exp.split("\n") if x]
    if lines == [exp] or lines == exp_lines:
        return True
    lines = [x for x in lines if x]
    return lines == exp_lines or _lines_close(lines, exp_lines)


def _int_keys(value: Any) -> Any:
    """A dict with its keys made ints, as verl turns JSON objects of expected outputs into ``[dict]``."""
    try:
        return [{int(k): v for k, v in value.items()}]
    except (ValueError, TypeError):
        return value


def call_matches(result: Any, expected_json: str) -> bool:
    """Whether a function's result passes a call test, by verl's rules."""
    expected = json.loads(expected_json)
    if isinstance(expected, dict):
        expected = _int_keys(expected)
    elif isinstance(expected, list) and expected and isinstance(expected[0], dict):
        expected = _int_keys(expected[0])
    if isinstance(result, tuple):
        result = list(result)
    if result == expected or (isinstance(expected, list) and expected and result == expected[0]):
        return True
    try:
        return isinstance(result[0], tuple) and [list(x) for x in result] == expected[0]
    except (TypeError, IndexError, KeyError):
        return False


def _call_result(r: Result) -> tuple[bool, Any]:
    """The result a call test printed, read as a Python literal (never evaluated)."""
    if not r.ok or _MARK not in r.stdout:
        return False, None
    try:
        return True, ast.literal_eval(r.stdout.rsplit(_MARK, 1)[1])
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False, None


def run_test(code: str, tests: dict, i: int | None) -> tuple[bool, Result]:
    """Test ``i`` of ``tests`` (None: only load the program) in a sandbox: passed, and how it ran."""
    fn = tests.get("fn_name")
    mode = "call" if fn else "stdin"
    if i is None:  # load the program (and, for call tests, find the function), as verl does before any test
        probe = "\n(getattr(Solution(), _fn) if 'class Solution' in _src else globals()[_fn])\n" if fn else ""
        r = shared().run(_HARNESS.format(src=code, mode="load", fn=fn, args="", mark=_MARK) + probe)
        return r.ok, r
    given = tests["inputs"][i]
    if mode == "stdin":
        stdin = "\n".join(given) if isinstance(given, list) else str(given)
        r = shared().run(_HARNESS.format(src=code, mode=mode, fn=None, args="", mark=_MARK), stdin)
        return r.ok and stdout_matches(r.stdout, tests["outputs"][i]), r
    r = shared().run(_HARNESS.format(src=code, mode=mode, fn=str(fn), args=str(given), mark=_MARK))
    ok, result = _call_result(r)
    try:
        return ok and call_matches(result, tests["outputs"][i]), r
    except (ValueError, TypeError):  # an expected output that is not JSON: verl fails the test
        return False, r


def code_score(solution_str: str, ground_truth: Any) -> dict:
    """verl's code score of a response (see the module docstring), with ``tests_passed`` and
    ``tests_run`` beside it."""
    tests = _tests(ground_truth)
    if tests is None:
        return {"score": 0.0, "tests_passed": 0.0, "tests_run": 0.0}
    code = extract_code(solution_str)
    n = min(len(tests["inputs"]), len(tests["outputs"]), SCORED_TESTS)
    if n == 0:
        loaded, _ = run_test(code, tests, None)
        return {"score": float(loaded), "tests_passed": 0.0, "tests_run": 0.0}
    passed, timed_out = 0, False
    for i in range(n):
        if timed_out:
            break
        ok, r = run_test(code, tests, i)
        passed += ok
        timed_out = r.timed_out
    return {"score": passed / n, "tests_passed": float(passed), "tests_run": float(n)}
