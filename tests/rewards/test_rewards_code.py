"""verl's code rewards (offstep/rewards/code.py), on hand-picked programs whose verl score is worked
out in the comments from verl's prime_code (continuous=True, as default_compute_score calls it):
all tests first, 1.0 if every one passes; otherwise each of the first ten alone, the share passing."""

import json

import pytest

from offstep.rewards.code import call_matches, code_score, extract_code, stdout_matches
from offstep.rewards.registry import RewardFunction
from offstep.rewards.sources import CODE_SOURCES, builtin_scorer
from offstep.sandbox import Limits, configure

pytestmark = pytest.mark.heavy  # a sandbox per test case: a few tenths of a second each

ADD = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


@pytest.fixture(autouse=True, scope="module")
def quick_sandbox():
    """The process's sandbox with a 3 s wall clock, for the program that hangs; the default after."""
    configure(Limits(timeout_s=3))
    yield
    configure()


def fenced(code: str) -> str:
    return f"Let me think.\n```python\n{code}\n```\nDone."


def score(response: str, truth) -> float:
    return code_score(response, truth)["score"]


def test_the_code_is_after_the_last_python_fence():
    assert extract_code("```python\nprint(1)\n```\ntext\n```python\nprint(2)\n```") == "\nprint(2)\n"
    assert extract_code("print(3)") == "print(3)"  # no fence: the whole response
    assert extract_code("x\n```python\nprint(4)") == "\nprint(4)"  # unclosed: to the end
    assert extract_code("```py\nprint(5)\n```") == ""  # verl looks for ```python only: before the first ``` nothing


def test_stdin_tests_all_passing_score_one_as_a_json_row():
    # a codecontests-style row: ground truth as the JSON string verl's parquet files hold
    truth = json.dumps({"inputs": ["1 2\n", "3 4\n", "-5 5\n"], "outputs": ["3\n", "7\n", "0\n"]})
    assert RewardFunction()("codecontests", ADD, truth) == (1.0, {"tests_passed": 3.0, "tests_run": 3.0})


def test_partial_credit_is_the_share_of_tests_passed():
    # abs(a) + b: right on 3 of 4 tests -> verl: the full run fails, then 3 of 4 one by one = 0.75
    truth = {"inputs": ["1 2", "3 4", "-5 5", "0 0"], "outputs": ["3", "7", "0", "0"]}
    assert score(fenced("a, b = map(int, input().split())\nprint(abs(a) + b)"), truth) == 0.75


def test_only_the_first_ten_tests_are_scored_after_a_failure():
    # 12 tests, the program fails the 11th and 12th: verl's full run fails, and the first ten alone all
    # pass -> 10/10 = 1.0; failing the 2nd instead -> 9/10
    ins = [f"{i} {i}" for i in range(12)]
    outs = [str(2 * i) for i in range(10)] + ["-1", "-1"]
    assert score(ADD, {"inputs": ins, "outputs": outs}) == 1.0
    outs2 = ["0", "-1"] + [str(2 * i) for i in range(2, 12)]
    assert score(ADD, {"inputs": ins, "outputs": outs2}) == 0.9


def test_stdout_is_compared_by_verls_rules():
    assert stdout_matches("3  \n\n", "3\n")  # stripped text
    assert stdout_matches("1 \n2\n", ["1", "2"])  # a list of lines is joined
    assert stdout_matches("0.3333333\n", "0.33333333333")  # within 1e-5 relative
    assert stdout_matches("3\n", "3.0")  # not all whole numbers: compared as floats
    assert not stdout_matches("010\n", "10")  # whole numbers: compared as text
    assert not stdout_matches("0.334\n", "0.3333333")
    assert not stdout_matches("1 2\n", "1 2 3")


def test_verls_imports_come_first_and_sys_exit_ends_cleanly():
    # verl prepends star imports of math, sys, ... and catches SystemExit: both programs pass
    truth = {"inputs": ["16"], "outputs": ["4.0"]}
    assert score(fenced("print(sqrt(int(input())))"), truth) == 1.0
    assert score(fenced("print(sqrt(int(input())))\nsys.exit(3)"), truth) == 1.0


def test_a_crash_fails_its_test_only_and_a_syntax_error_fails_all():
    truth = {"inputs": ["1", "0", "2"], "outputs": ["1.0", "x", "0.5"]}
    assert score(fenced("print(1 / int(input()))"), truth) == pytest.approx(2 / 3)  # ZeroDivisionError on one
    assert score(fenced("print(1 /"), truth) == 0.0


def test_call_tests_by_fn_name():
    truth = {
        "fn_name": "plus",
        "inputs": ["1\n2", "[1, 2]\n[3]", "\"a\"\n\"b\""],
        "outputs": ["3", "[1, 2, 3]", "\"ba\""],
    }
    # prints are not the output; the return value is: the third returns "ab", not "ba" -> 2/3
    assert score(fenced("def plus(a, b):\n    print('noise')\n    return a + b"), truth) == pytest.approx(2 / 3)
    assert score(fenced("class Solution:\n    def plus(self, a, b):\n        return a + b"), truth) == pytest.approx(
        2 / 3
    )
    assert score(fenced("def other(a, b):\n    return a + b"), truth) == 0.0  # no such function: verl's -2
    # verl's star imports are the program's globals: operator.add answers for fn_name "add" (verl too)
    assert score(fenced("pass"), {**truth, "fn_name": "add"}) == pytest.approx(2 / 3)


def test_call_results_are_compared_by_verls_rules():
    assert call_matches((1, 2), "[1, 2]")  # a tuple is a list
    assert call_matches(5, "[5]")  # the first element of a one-list
    assert call_matches({1: "a"}, '{"1": "a"}')  # JSON object keys read as ints
    assert call_matches([(1, 2), (3, 4)], "[[[1, 2], [3, 4]]]")
    assert not call_matches([1, 2], "[2, 1]")


def test_a_program_that_hangs_scores_zero_and_stops_early():
    truth = {"inputs": ["", "", ""], "outputs": ["1", "2", "3"]}
    result = code_score(fenced("while True:\n    pass"), truth)
    assert result == {"score": 0.0, "tests_passed": 0.0, "tests_run": 3.0}


def test_no_tests_score_one_when_the_program_loads_and_bad_truth_zero():
    # verl: the full run over no tests passes (all([]) is True) once the program compiles
    assert score(fenced("print(1)"), {"inputs": [], "outputs": []}) == 1.0
    assert score(fenced("print(1 /"), {"inputs": [], "outputs": []}) == 0.0
    assert score(fenced("def f(): pass"), {"fn_name": "g", "inputs": [], "outputs": []}) == 0.0
    assert score(ADD, "not json") == 0.0 and score(ADD, {"inputs": ["1 2"]}) == 0.0


def test_verls_code_sources_route_here():
    for source in CODE_SOURCES:
        assert builtin_scorer(source).__name__ == "prime_code"
