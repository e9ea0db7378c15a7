"""Bad input through the user's entry point, ``offstep train``: each case ends with exit code 2 and
one message on stderr that names the problem and the fix, with no traceback.

Problems that can be seen in the configuration, the data, the model folder or the reward file are
caught before Ray starts (the fast cases, run in-process through ``offstep.cli.main``). A reward
function that misbehaves only shows when it scores real responses: those runs go through Ray in a
subprocess of ``.venv/bin/offstep``, which must exit cleanly, in bounded time, leaving no process
of the run behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest

from offstep.cli import main

TINY = ["preset=tiny", "trainer.progress=off", "trainer.total_steps=2"]


def verl_rows(n: int, content: str = "What is 1 + 1?") -> list[dict]:
    return [
        {"data_source": "arithmetic", "prompt": [{"role": "user", "content": content}], "ability": "math",
         "reward_model": {"style": "rule", "ground_truth": "2"}, "extra_info": {"index": i}}
        for i in range(n)
    ]


def write(path: Path, text: str | bytes) -> str:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(textwrap.dedent(text))
    return str(path)


# Each case: (tmp_path -> overrides, substrings the message must contain). The substrings name the
# problem and the key or the fix.
def _missing_file(tmp):
    return [f"data.train_files=[{tmp / 'nope.parquet'}]"]


def _corrupt_parquet(tmp):
    return [f"data.train_files=[{write(tmp / 'bad.parquet', b'PAR1 this is not parquet')}]"]


def _corrupt_jsonl(tmp):
    path = write(tmp / "bad.jsonl", '{"prompt": "What is 1 + 1?"}\n{not json\n')
    return [f"data.train_files=[{path}]"]


def _missing_prompt_column(tmp):
    f = tmp / "noprompt.parquet"
    pd.DataFrame([{k: v for k, v in r.items() if k != "prompt"} for r in verl_rows(8)]).to_parquet(f)
    return [f"data.train_files=[{f}]"]


def _missing_answer_column(tmp):
    f = write(tmp / "noanswer.jsonl", "".join(json.dumps({"question": f"q{i}"}) + "\n" for i in range(8)))
    return [f"data.train_files=[{f}]", "data.prompt_key=question", "data.answer_key=answer"]


def _empty_dataset(tmp):
    return [f"data.train_files=[{write(tmp / 'empty.jsonl', '')}]"]


def _all_prompts_too_long(tmp):
    return ["data.max_prompt_length=4"]


def _too_few_prompts(tmp):
    f = tmp / "few.parquet"
    pd.DataFrame(verl_rows(2)).to_parquet(f)
    return [f"data.train_files=[{f}]"]


def _reward_path_missing(tmp):
    return [f"reward.custom_path={tmp / 'nope.py'}"]


def _reward_name_missing(tmp):
    path = write(tmp / "r.py", "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    return [f"reward.custom_path={path}", "reward.custom_name=my_score"]


def _reward_file_does_not_import(tmp):
    path = write(tmp / "broken.py", "import no_such_module_xyz\n")
    return [f"reward.custom_path={path}"]


def _unknown_data_source(tmp):
    f = tmp / "src.parquet"
    rows = verl_rows(8)
    for r in rows:
        r["data_source"] = "my/task"
    pd.DataFrame(rows).to_parquet(f)
    return [f"data.train_files=[{f}]"]


def _model_missing(tmp):
    return [f"model.path={tmp / 'no_model'}"]


def _model_not_causal_lm(tmp):
    d = tmp / "bert"
    d.mkdir()
    write(d / "config.json", json.dumps({"model_type": "bert", "architectures": ["BertForSequenceClassification"]}))
    write(d / "model.safetensors", b"")
    return [f"model.path={d}"]


CASES = {
    "missing dataset file": (_missing_file, ["nope.parquet", "does not exist", "data.train_files"]),
    "corrupt parquet": (_corrupt_parquet, ["bad.parquet", "Fix"]),
    "corrupt jsonl": (_corrupt_jsonl, ["bad.jsonl", "line 2", "Fix"]),
    "missing prompt column": (_missing_prompt_column, ["'prompt'", "data.prompt_key"]),
    "missing answer column": (_missing_answer_column, ["'answer'", "data.answer_key"]),
    "empty dataset": (_empty_dataset, ["empty.jsonl", "empty", "Fix"]),
    "every prompt too long": (_all_prompts_too_long, ["data.max_prompt_length"]),
    "fewer prompts than a batch": (_too_few_prompts, ["data.train_batch_size"]),
    "reward path missing": (_reward_path_missing, ["nope.py", "reward.custom_path"]),
    "reward function name missing": (_reward_name_missing, ["'my_score'", "reward.custom_name", "compute_score"]),
    "reward file does not import": (_reward_file_does_not_import, ["broken.py", "no_such_module_xyz", "Fix"]),
    "data source without scorer": (_unknown_data_source, ["my/task", "reward.custom_path"]),
    "model path missing": (_model_missing, ["no_model", "does not exist", "model.path"]),
    "model not a causal LM": (_model_not_causal_lm, ["bert", "not a causal language model"]),
}

OPTION_CASES = {
    "colocate with off-policy": (["pipeline.colocate=true", "pipeline.max_staleness=1"], ["pipeline.colocate", "max_staleness=0"]),
    "grpo with one sample": (["rollout.n=1"], ["rollout.n", "algorithm.adv_estimator"]),
    "batch does not divide": (["actor.mini_batch_size=3"], ["actor.mini_batch_size", "divide"]),
    "unknown key": (["trainer.total_stepz=1"], ["unknown configuration key 'trainer.total_stepz'", "did you mean trainer.total_steps"]),
    "wrong type": (["trainer.total_steps=many"], ["bad value for trainer.total_steps", "'many'", "Fix"]),
    "nan learning rate": (["actor.optim.lr=nan"], ["actor.optim.lr", "finite"]),
    "bad nonfinite policy": (["actor.nonfinite=ignore"], ["actor.nonfinite", "skip", "stop"]),
    "bad critic nonfinite policy": (["critic.nonfinite=warn"], ["critic.nonfinite", "skip", "stop"]),
    "zero reward timeout": (["reward.timeout_s=0"], ["reward.timeout_s", "null"]),
}


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["train", *args])
    return rc, capsys.readouterr().err


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if the run gets as far as starting Ray workers (other tests of the session
    may have started Ray itself, so "Ray is not initialised" cannot be the check)."""
    from offstep.pipeline import controller

    def refuse(*args):
        raise AssertionError("worker processes were started before the bad input was caught")

    monkeypatch.setattr(controller, "start_workers", refuse)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_before_ray_with_a_clear_message(case, tmp_path, capsys, no_workers):
    make, expected = CASES[case]
    rc, err = run_cli([*TINY, f"trainer.output_dir={tmp_path / 'run'}", *make(tmp_path)], capsys)
    assert rc == 2, err
    assert err.startswith("offstep: ") and "Traceback" not in err, err
    for text in expected:
        assert text in err, (text, err)


@pytest.mark.parametrize("case", sorted(OPTION_CASES))
def test_incompatible_options_fail_with_the_key(case, tmp_path, capsys):
    overrides, expected = OPTION_CASES[case]
    rc, err = run_cli([*TINY, f"trainer.output_dir={tmp_path / 'run'}", *overrides], capsys)
    assert rc == 2, err
    assert err.startswith("offstep: ") and "Traceback" not in err, err
    for text in expected:
        assert text in err, (text, err)
    assert not (tmp_path / "run").exists()  # rejected before the run directory is made


# --------------------------------------------------------------------------------------------------
# reward functions that misbehave during the run

SCORERS = """
import time

def raises(data_source, solution_str, ground_truth, extra_info=None):
    return {"answer": 1}["score"]

def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")

def hangs(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(3600)
    return 1.0
"""

REWARD_CASES = {
    "raises": ["raised KeyError: 'score'", "scorers.py:5", "Fix: make the scorer handle every response"],
    "not_a_number": ["returned a non-number str", "Fix: make the scorer return a finite number"],
    "nan": ["returned a non-finite score nan", "Fix: make the scorer return a finite number"],
    "hangs": ["timed out after 2 s (reward.timeout_s)", "raise reward.timeout_s"],
}

OFFSTEP = Path(sys.executable).with_name("offstep")


def run_and_watch(args: list[str], timeout_s: float = 600) -> tuple[subprocess.CompletedProcess, list[psutil.Process]]:
    """Run ``offstep train ARGS`` in a subprocess; return it and every process it started (its
    descendants, sampled while it ran: Ray's GCS and raylet, the workers)."""
    cmd = [str(OFFSTEP), "train", *args]
    env = {**os.environ, "RAY_ADDRESS": ""}  # its own local Ray, never a cluster of another test
    seen: dict[int, psutil.Process] = {}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as p:
        deadline = time.monotonic() + timeout_s
        # drain the pipes in threads so a chatty run never blocks on a full pipe
        outs = {"stdout": [], "stderr": []}
        readers = [threading.Thread(target=lambda s=s, k=k: outs[k].append(s.read()), daemon=True)
                   for k, s in (("stdout", p.stdout), ("stderr", p.stderr))]
        for r in readers:
            r.start()
        parent = psutil.Process(p.pid)
        while p.poll() is None:
            if time.monotonic() > deadline:
                for child in parent.children(recursive=True):
                    child.kill()
                p.kill()
                pytest.fail(f"offstep train did not end within {timeout_s} s: {cmd}")
            try:
                for child in parent.children(recursive=True):
                    seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.2)
        for r in readers:
            r.join(30)
        result = subprocess.CompletedProcess(cmd, p.returncode, "".join(outs["stdout"]), "".join(outs["stderr"]))
    return result, list(seen.values())


def alive(procs: list[psutil.Process]) -> list[str]:
    """The processes in ``procs`` still running (same pid and start time), described."""
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REWARD_CASES))
def test_bad_reward_function_ends_the_run_cleanly(name, tmp_path):
    path = write(tmp_path / "scorers.py", SCORERS)
    result, procs = run_and_watch([
        *TINY, f"trainer.output_dir={tmp_path / 'run'}", f"reward.custom_path={path}", f"reward.custom_name={name}",
        "reward.timeout_s=2",
    ])
    err = result.stderr
    assert result.returncode == 2, err
    assert "Traceback" not in err, err
    line = [ln for ln in err.splitlines() if ln.startswith("offstep: ")]
    assert len(line) == 1, err
    msg = line[0]
    assert "reward for data source 'arithmetic' failed: custom scorer" in msg and path in msg, msg
    for text in REWARD_CASES[name]:
        assert text in msg, (text, msg)
    assert procs, "the run started no process: it failed before Ray, which is not what this test is for"
    deadline = time.monotonic() + 30
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(procs), alive(procs)


# --------------------------------------------------------------------------------------------------
# the reward function's own messages (in-process)

LIBRARY_RAISE = """
import json

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return json.loads(solution_str)["score"]  # line 5: raises inside json for plain text

def too_big(data_source, solution_str, ground_truth, extra_info=None):
    return 1e39
"""


def test_reward_error_points_at_the_scorer_line_and_says_how_to_fix(tmp_path):
    from offstep.rewards.registry import RewardError, RewardFunction

    path = write(tmp_path / "lib.py", LIBRARY_RAISE)
    with pytest.raises(RewardError) as info:
        RewardFunction(path)("src", "not json", "1")
    msg = str(info.value)
    # the innermost frame is in the json module; the line worth showing is the scorer's own
    assert "raised JSONDecodeError" in msg and f"at {path}:5." in msg, msg
    assert "Fix: make the scorer handle every response" in msg


def test_reward_beyond_float32_is_an_error(tmp_path):
    from offstep.rewards.registry import RewardError, RewardFunction

    path = write(tmp_path / "lib.py", LIBRARY_RAISE)
    # 1e39 is a finite Python float, but the batch holds scores as float32, where it is inf
    with pytest.raises(RewardError, match="beyond float32's range"):
        RewardFunction(path, "too_big")("src", "x", "1")
