"""Tests for offstep.rewards: rule scorers, custom scorer loading and RewardFunction."""

from __future__ import annotations

import json
import pickle
import textwrap
import threading

import pytest

from offstep.rewards.registry import (
    BUILTIN_SCORERS,
    RewardConfigError,
    RewardError,
    RewardFunction,
    load_custom_scorer,
)
from offstep.rewards.scorers import (
    extract_gsm8k_answer,
    gsm8k_score,
    last_number,
    last_number_score,
    plain_answer_score,
)

# --------------------------------------------------------------------------------------------------
# gsm8k_score


@pytest.mark.parametrize(
    "text, truth, expected",
    [
        ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0),
        ("#### 1,234", "1234", 1.0),  # commas stripped
        ("#### -5", "-5", 1.0),
        ("#### 7\nwait, actually\n#### 8", "8", 1.0),  # the last "#### " counts
        ("#### 7\nwait, actually\n#### 8", "7", 0.0),
        ("The answer is 7", "7", 0.0),  # strict needs "#### "
        ("####7", "7", 0.0),  # ... with the space
        ("#### 72.", "72", 0.0),  # verl compares strings: "72." != "72"
        ("#### 6", 6, 1.0),  # a non-string ground truth is compared as a string
    ],
)
def test_gsm8k_strict(text, truth, expected):
    assert gsm8k_score(text, truth) == expected


def test_gsm8k_format_score_and_score():
    assert gsm8k_score("#### 5", "6", format_score=0.1) == 0.1  # answer found but wrong
    assert gsm8k_score("no answer", "6", format_score=0.1) == 0.0  # nothing extracted
    assert gsm8k_score("#### 6", "6", score=2.0) == 2.0


def test_gsm8k_flexible():
    assert gsm8k_score("so it is 3, then 12 apples.", "12", method="flexible") == 1.0
    assert gsm8k_score("costs $1,500 in total", "1500", method="flexible") == 1.0
    assert gsm8k_score("first 12 then 13", "12", method="flexible") == 0.0
    assert gsm8k_score("no digits here.", "1", method="flexible") == 0.0
    assert extract_gsm8k_answer("answer: -4 .", method="flexible") == "-4"


def test_gsm8k_only_last_300_chars():
    head = "#### 42\n"
    text = head + "x" * 300
    assert gsm8k_score(text, "42") == 0.0  # the "####" line is clipped away
    assert gsm8k_score("#### 42" + "y" * 293, "42") == 1.0  # exactly 300 chars: kept
    assert gsm8k_score("#### 42" + "y" * 294, "42") == 0.0


def test_gsm8k_bad_method():
    with pytest.raises(ValueError):
        gsm8k_score("#### 1", "1", method="loose")


# --------------------------------------------------------------------------------------------------
# last_number_score


@pytest.mark.parametrize(
    "text, truth, expected",
    [
        ("23 + 58 = 81", "81", 1.0),
        ("The answer is 81.", "81", 1.0),
        ("81 is wrong, it is 80", "81", 0.0),
        ("x = -7", "-7", 1.0),
        ("x = -7", "7", 0.0),
        ("5-3=2", "2", 1.0),  # "-3" here is subtraction, not a negative number
        ("10-3", "3", 1.0),
        ("Total: 1,234 apples", "1234", 1.0),
        ("Total: 1,234 apples", 1234, 1.0),
        ("It is 12.0", "12", 1.0),
        ("It is 12", "12.0", 1.0),
        ("It is 12.5", "12", 0.0),
        ("It is 0.5", 0.5, 1.0),
        ("$3,000.25", "3000.25", 1.0),
        ("no numbers", "1", 0.0),
        ("", "0", 0.0),
        ("42", "not a number", 0.0),
        ("1", True, 0.0),
    ],
)
def test_last_number_score(text, truth, expected):
    assert last_number_score(text, truth) == expected


def test_last_number():
    assert last_number("a 1 b 2 c 3.5") == 3.5
    assert last_number("-12,000") == -12000.0
    assert last_number("nothing") is None


# --------------------------------------------------------------------------------------------------
# plain_answer_score: the calculator task (a number counts only in a plain final answer)


@pytest.mark.parametrize(
    "final_turn, ended_by, expected",
    [
        # The loop ended on a turn without a call whose last number is 47 * 86 = 4042: 1 (after a
        # tool result, or with no tool at all: the final turn is all that is read).
        ("The answer is 4042.", "answer", 1.0),
        ("47 * 86 = 4042", "answer", 1.0),
        ("The answer is 4041.", "answer", 0.0),
        ("I do not know.", "answer", 0.0),
        # The right number inside a call that was cut by the budget, or never run at max_turns: 0.
        ("<calculator>4042", "budget", 0.0),
        ("<calculator>4042</calculator>", "max_turns", 0.0),
        # A plain answer cut by the budget before the model ended its turn: 0.
        ("The answer is 4042", "budget", 0.0),
        # No loop (one turn, the no-tool baseline): the answer counts unless it holds a call.
        ("47 * 86 = 4042", None, 1.0),
        ("<calculator>47 * 86</calculator> 4042", None, 0.0),
    ],
)
def test_plain_answer_score(final_turn, ended_by, expected):
    assert plain_answer_score(final_turn, "4042", ended_by, "<calculator>") == expected


def test_calculator_scorer_reads_the_loop_not_the_whole_response():
    """The built-in ``calculator`` scorer: the loop's ``final_text`` and ``ended_by`` decide; the tool's
    answer 4042 earlier in the response never counts."""
    calc = BUILTIN_SCORERS["calculator"]
    whole = "<calculator>47 * 86</calculator>\ntool\n4042\nassistant\n"
    after_tool = {"num_turns": 2, "final_text": "The answer is 4042.", "ended_by": "answer"}
    assert calc("calculator", whole + "The answer is 4042.", "4042", extra_info=after_tool) == 1.0
    no_tool = {"num_turns": 1, "final_text": "4042", "ended_by": "answer"}
    assert calc("calculator", "4042", "4042", extra_info=no_tool) == 1.0
    in_call = {"num_turns": 2, "final_text": "<calculator>4042</calculator>", "ended_by": "max_turns"}
    assert calc("calculator", whole + "<calculator>4042</calculator>", "4042", extra_info=in_call) == 0.0
    cut = {"num_turns": 2, "final_text": "<calculator>40", "ended_by": "budget"}
    assert calc("calculator", whole + "<calculator>40", "4042", extra_info=cut) == 0.0
    assert calc("calculator", whole, "4042", extra_info={"index": 0}) == 0.0  # one turn, a call nothing ran
    assert calc("calculator", "47 * 86 = 4042", "4042", extra_info={"index": 0}) == 1.0


# --------------------------------------------------------------------------------------------------
# built-in registry


def test_builtin_scorers_signature():
    assert set(BUILTIN_SCORERS) >= {"openai/gsm8k", "gsm8k", "arithmetic"}
    assert BUILTIN_SCORERS["openai/gsm8k"]("openai/gsm8k", "#### 3", "3") == 1.0
    assert BUILTIN_SCORERS["gsm8k"]("gsm8k", "3", "3", extra_info={"a": 1}) == 0.0  # strict
    assert BUILTIN_SCORERS["arithmetic"]("arithmetic", "so 3", "3", extra_info=None) == 1.0


def test_reward_function_builtin():
    rf = RewardFunction()
    assert rf("openai/gsm8k", "3 + 4 = 7\n#### 7", "7") == (1.0, {})
    assert rf("arithmetic", "The answer is 12", "13") == (0.0, {})
    score, extras = rf("gsm8k", "#### 7", "7", extra_info={"split": "val"})
    assert score == 1.0 and extras == {}
    assert isinstance(score, float)


def test_check_sources_builtin():
    rf = RewardFunction()
    rf.check_sources(["openai/gsm8k", "arithmetic", "gsm8k"])
    with pytest.raises(ValueError) as ei:
        rf.check_sources(["arithmetic", "my/task", "other"])
    msg = str(ei.value)
    assert "my/task" in msg and "other" in msg and "openai/gsm8k" in msg
    assert "reward.custom_path=" in msg and "reward.custom_name=" in msg
    assert isinstance(ei.value, RewardError)


def test_unknown_source_at_call_time():
    with pytest.raises(RewardError, match="my/task"):
        RewardFunction()("my/task", "1", "1")


# --------------------------------------------------------------------------------------------------
# custom scorers


def write_scorer(tmp_path, body, name="scorer.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


FLOAT_SCORER = """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        bonus = (extra_info or {}).get("bonus", 0.0)
        return float(solution_str.strip() == str(ground_truth)) + bonus

    def helper():
        return 1
"""

DICT_SCORER = """
    import numpy as np

    def my_score(data_source, solution_str, ground_truth, extra_info=None):
        ok = solution_str == ground_truth
        return {"score": 2.0 if ok else -1.0, "acc": ok, "length": len(solution_str),
                "np_val": np.float32(0.5), "note": "ignored", "source": data_source}
"""


def test_load_custom_scorer_float(tmp_path):
    fn = load_custom_scorer(write_scorer(tmp_path, FLOAT_SCORER))
    assert fn("anything", " 5 ", 5) == 1.0


def test_reward_function_custom_float(tmp_path):
    rf = RewardFunction(custom_path=write_scorer(tmp_path, FLOAT_SCORER))
    rf.check_sources(["any/source", "another"])  # a custom scorer accepts every source
    assert rf("any/source", "5", "5") == (1.0, {})
    assert rf("openai/gsm8k", "5", "5", extra_info={"bonus": 0.5}) == (1.5, {})  # overrides built-ins


def test_reward_function_custom_dict(tmp_path):
    rf = RewardFunction(custom_path=write_scorer(tmp_path, DICT_SCORER), custom_name="my_score")
    score, extras = rf("x", "abc", "abc")
    assert score == 2.0
    assert extras == {"acc": 1.0, "length": 3.0, "np_val": 0.5}
    assert all(type(v) is float for v in extras.values())
    score, extras = rf("x", "abc", "abd")
    assert score == -1.0 and extras["acc"] == 0.0


def test_reward_function_is_picklable_and_lazy(tmp_path):
    rf = RewardFunction(custom_path=write_scorer(tmp_path, FLOAT_SCORER), timeout_s=5.0)
    assert rf._custom_fn is None  # nothing imported at construction
    assert rf("s", "1", "1") == (1.0, {})
    assert rf._custom_fn is not None
    clone = pickle.loads(pickle.dumps(rf))
    assert clone._custom_fn is None
    assert clone.custom_path == rf.custom_path and clone.timeout_s == 5.0
    assert clone("s", "2", "2") == (1.0, {})
    # a RewardFunction with a bad path still pickles; the error surfaces on use
    bad = pickle.loads(pickle.dumps(RewardFunction(custom_path=str(tmp_path / "missing.py"))))
    with pytest.raises(RewardError):
        bad("s", "1", "1")


def test_load_custom_scorer_missing_file(tmp_path, capsys):
    path = str(tmp_path / "nope.py")
    with pytest.raises(RewardError) as ei:
        load_custom_scorer(path)
    assert path in str(ei.value) and "reward.custom_path" in str(ei.value)
    # Bad input, reported as such: the command prints the message alone (naming its own flag) and
    # exits with code 2, before any model loads.
    from offstep.cli import main

    data = tmp_path / "val.jsonl"
    data.write_text(
        json.dumps(
            {
                "prompt": [{"role": "user", "content": "What is 1 + 1?"}],
                "data_source": "mine",
                "reward_model": {"ground_truth": "2"},
            }
        )
        + "\n"
    )
    capsys.readouterr()
    rc = main(["eval", "tiny", "--data", str(data), "--reward-path", path, "--out", str(tmp_path / "out.json")])
    err = capsys.readouterr().err
    assert rc == 2 and f"offstep: custom reward file {path} not found. Fix: set --reward-path" in err, err
    assert "Traceback" not in err and not (tmp_path / "out.json").exists(), err


def test_load_custom_scorer_import_error(tmp_path):
    path = write_scorer(tmp_path, "import not_a_real_module_xyz\n", name="broken.py")
    with pytest.raises(RewardConfigError) as ei:
        load_custom_scorer(path)
    msg = str(ei.value)
    assert path in msg and "not_a_real_module_xyz" in msg and "ModuleNotFoundError" in msg
    assert isinstance(ei.value.__cause__, ModuleNotFoundError)


def test_load_custom_scorer_syntax_error(tmp_path):
    path = write_scorer(tmp_path, "def compute_score(:\n", name="syntax.py")
    with pytest.raises(RewardConfigError, match="SyntaxError"):
        load_custom_scorer(path)


def test_load_custom_scorer_missing_function(tmp_path):
    path = write_scorer(tmp_path, FLOAT_SCORER)
    with pytest.raises(RewardConfigError) as ei:
        load_custom_scorer(path, name="score_fn")
    msg = str(ei.value)
    assert "'score_fn'" in msg and "compute_score" in msg and "helper" in msg
    assert "reward.custom_name" in msg and path in msg


def test_load_custom_scorer_not_callable(tmp_path):
    path = write_scorer(tmp_path, "compute_score = 3\ndef real(*a, **k):\n    return 1\n")
    with pytest.raises(RewardConfigError, match="non-callable 'compute_score'.*real"):
        load_custom_scorer(path)


def test_check_sources_imports_custom_early(tmp_path):
    rf = RewardFunction(custom_path=write_scorer(tmp_path, FLOAT_SCORER), custom_name="nope")
    with pytest.raises(ValueError, match="nope"):
        rf.check_sources(["a"])


# --------------------------------------------------------------------------------------------------
# RewardError cases


BAD_SCORERS = """
    import math

    def raises(data_source, solution_str, ground_truth, extra_info=None):
        raise KeyError("boom")

    def returns_none(data_source, solution_str, ground_truth, extra_info=None):
        return None

    def returns_str(data_source, solution_str, ground_truth, extra_info=None):
        return "1.0"

    def returns_nan(data_source, solution_str, ground_truth, extra_info=None):
        return float("nan")

    def returns_inf(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": math.inf}

    def dict_without_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"reward": 1.0}

    def dict_bad_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": [1.0]}

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        import time
        time.sleep(5)
        return 1.0
"""


@pytest.mark.parametrize(
    "name, problem",
    [
        ("raises", "raised KeyError"),
        ("returns_none", "non-number NoneType"),
        ("returns_str", "non-number str"),
        ("returns_nan", "non-finite"),
        ("returns_inf", "non-finite"),
        ("dict_without_score", "without a 'score' key"),
        ("dict_bad_score", "non-number list"),
    ],
)
def test_reward_errors(tmp_path, name, problem):
    path = write_scorer(tmp_path, BAD_SCORERS, name="bad.py")
    rf = RewardFunction(custom_path=path, custom_name=name)
    sample = "S" * 150 + "T" * 100 + "TAIL_NOT_SHOWN"
    with pytest.raises(RewardError) as ei:
        rf("my/source", sample, "1")
    msg = str(ei.value)
    assert problem in msg
    assert "'my/source'" in msg and name in msg and path in msg
    assert repr(sample[:200]) in msg and "TAIL_NOT_SHOWN" not in msg
    if name == "raises":
        assert isinstance(ei.value.__cause__, KeyError)


def test_reward_timeout_main_thread(tmp_path):
    path = write_scorer(tmp_path, BAD_SCORERS, name="bad.py")
    rf = RewardFunction(custom_path=path, custom_name="slow", timeout_s=0.2)
    with pytest.raises(RewardError, match="timed out after 0.2 s"):
        rf("src", "x", "1")
    # the alarm is cleaned up: a normal scorer still works afterwards
    assert RewardFunction(timeout_s=0.2)("arithmetic", "1", "1") == (1.0, {})


def test_reward_timeout_in_worker_thread(tmp_path):
    path = write_scorer(tmp_path, BAD_SCORERS, name="bad.py")
    rf = RewardFunction(custom_path=path, custom_name="slow", timeout_s=0.2)
    ok = RewardFunction(custom_path=path, custom_name="returns_nan", timeout_s=1.0)
    errors = []

    def work():
        for fn in (rf, ok):
            try:
                fn("src", "x", "1")
            except RewardError as exc:
                errors.append(str(exc))

    t = threading.Thread(target=work)
    t.start()
    t.join(5)
    assert not t.is_alive()
    assert "timed out" in errors[0] and "non-finite" in errors[1]
    assert RewardFunction(timeout_s=1.0)("arithmetic", "7", "7") == (1.0, {})


def test_reward_function_bad_timeout():
    with pytest.raises(ValueError, match="reward.timeout_s"):
        RewardFunction(timeout_s=0)


def test_numpy_score_accepted(tmp_path):
    path = write_scorer(
        tmp_path,
        """
        import numpy as np
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return np.float32(0.25)
        def zero_d(data_source, solution_str, ground_truth, extra_info=None):
            return np.array(0.75)
        """,
    )
    assert RewardFunction(custom_path=path)("s", "", "") == (0.25, {})
    assert RewardFunction(custom_path=path, custom_name="zero_d")("s", "", "") == (0.75, {})
