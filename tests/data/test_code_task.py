"""The built-in code task (offstep/data/code_task.py) and preset=code: its rows, their tests
passed by a right function and failed by a wrong one in the sandbox, and a one-step run whose
sandbox/ metrics are recorded."""

import json

import pyarrow.parquet as pq
import pytest

from offstep.data.code_task import FAMILIES, code
from offstep.data.dataset import load_records
from offstep.data.tasks import write_task
from offstep.launch.loader import load_config
from offstep.launch.preflight import environment_problems
from offstep.rewards.registry import RewardFunction

RIGHT = {  # a right answer to each family, written as a model would
    "scale": "def scale(x):\n    return x * {a} + {b}",
    "count_above": "def count_above(xs):\n    return len([v for v in xs if v > {k}])",
    "clamp": "def clamp(x):\n    return max({lo}, min({hi}, x))",
    "count_letter": "def count_letter(s):\n    return s.count('{c}')",
    "divisible": "def divisible(n):\n    return n % {k} == 0",
    "repeat": "def repeat(s):\n    return s * {k}",
    "shift_all": "def shift_all(xs):\n    return [v + {d} for v in xs]",
    "sum_even": "def sum_even(xs):\n    return sum(v for v in xs if v % 2 == 0)",
    "spread": "def spread(xs):\n    return max(xs) - min(xs)",
    "reverse_words": "def reverse_words(s):\n    return ' '.join(s.split(' ')[::-1])",
}


def test_rows_are_verl_rows_with_call_tests(tmp_path):
    train, val = write_task("code", str(tmp_path), 40, 8, seed=0)
    table = pq.read_table(train)
    assert set(table.column_names) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    for r in load_records(val):
        truth = json.loads(r.ground_truth)
        assert r.data_source == "code" and r.ability == "code" and len(truth["inputs"]) == len(truth["outputs"]) == 5
        assert r.messages[-1]["content"].startswith(f"Write a Python function {truth['fn_name']}(")
    with pytest.raises(ValueError, match="distinct problems"):
        code(sum(len(f[3]) for f in FAMILIES) + 1, 0)


@pytest.mark.heavy
def test_a_right_function_passes_and_a_wrong_one_gets_partial_credit():
    reward = RewardFunction()
    seen = {}
    for row in code(sum(len(f[3]) for f in FAMILIES), seed=1):
        name = json.loads(row["reward_model"]["ground_truth"])["fn_name"]
        seen.setdefault(name, row)
    assert set(seen) == set(RIGHT)
    for name, row in seen.items():
        params = next(
            p
            for f in FAMILIES
            if f[0] == name
            for p in f[3]
            if row["extra_info"]["question"] == f"Write a Python function {f[1]} that {f[2](**p)}."
        )
        answer = f"Here it is:\n```python\n{RIGHT[name].format(**params)}\n```"
        assert reward("code", answer, row["reward_model"]["ground_truth"])[0] == 1.0, (name, answer)
    wrong = "```python\ndef scale(x):\n    return 0\n```"
    truth = json.dumps({"fn_name": "scale", "inputs": ["0", "1"], "outputs": ["0", "5"]})
    assert reward("code", wrong, truth)[0] == 0.5


@pytest.mark.heavy
def test_the_preset_is_checked_for_a_sandbox():
    cfg = load_config(["preset=code"])
    assert (cfg.data.task, cfg.model.path, cfg.sandbox.timeout_s) == ("code", "smollm2-135m-instruct", 5.0)
    assert environment_problems(cfg) == []
    refused = environment_problems(load_config(["preset=tiny", "data.task=code", "sandbox.python=/usr/bin/nope"]))
    assert any("data.task=code is scored by running the model's code" in p for p in refused)


@pytest.mark.ray
@pytest.mark.slow  # two minutes on 2 cores
def test_one_step_of_the_code_task_records_sandbox_metrics(tmp_path, ray_session):
    from offstep.pipeline.controller import train
    from offstep.telemetry.metrics import read_jsonl
    from offstep.telemetry.names import Sandbox

    train(
        load_config(
            [
                "preset=tiny",
                "data.task=code",
                "data.task_train_size=16",
                "data.task_val_size=4",
                "trainer.total_steps=1",
                "trainer.val_before_train=false",
                f"trainer.output_dir={tmp_path}",
                "trainer.progress=off",
                "sandbox.timeout_s=10",
            ]
        )
    )
    (m,) = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["step"] == 1]
    # 4 prompts x 2 samples; the random model writes no function, so each sample's 5 tests all run and fail
    assert m[Sandbox.EXECUTIONS] == 40 and m[Sandbox.TIMEOUTS] == 0 and m["reward/mean"] == 0.0
    assert 0 < m[Sandbox.SECONDS_MEAN] <= m[Sandbox.SECONDS_P95] and m[Sandbox.QUEUE_WAIT_S] >= 0


@pytest.mark.ray
@pytest.mark.slow  # two minutes on 2 cores
def test_the_sandbox_metrics_in_the_fully_async_mode(tmp_path, ray_session):
    from offstep.pipeline.controller import train
    from offstep.telemetry.metrics import read_jsonl
    from offstep.telemetry.names import Sandbox

    train(
        load_config(
            [
                "preset=tiny",
                "data.task=code",
                "data.task_train_size=16",
                "data.task_val_size=4",
                "pipeline.mode=fully_async",
                "trainer.total_steps=2",
                "trainer.val_before_train=false",
                "trainer.val_freq=-1",
                f"trainer.output_dir={tmp_path}",
                "trainer.progress=off",
                "sandbox.timeout_s=10",
            ]
        )
    )
    steps = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["step"] >= 1]
    # each take hands over the runs recorded since the last one: a step counts at least its own batch's
    # 4 prompts x 2 samples x 5 tests (a group is taken once scored), plus runs of groups scored early for
    # later steps (scoring goes on beside the takes, so not in whole samples). A test that times out (a
    # loaded machine can stretch a run past sandbox.timeout_s) ends its sample's tests: at most 4 fewer runs.
    first = steps[0]
    assert first[Sandbox.EXECUTIONS] >= 40 - 4 * first[Sandbox.TIMEOUTS]
    assert 0 < first[Sandbox.SECONDS_MEAN] <= first[Sandbox.SECONDS_P95]
    timeouts = sum(m.get(Sandbox.TIMEOUTS, 0) for m in steps)
    assert timeouts <= 2, "the random model writes no loop: only a very loaded machine times a run out"
    assert sum(m.get(Sandbox.EXECUTIONS, 0) for m in steps) >= 80 - 4 * timeouts
