"""Bad input through the user's entry point, ``offstep train``: each case ends with exit code 2 and
one message on stderr that names the problem and the fix, with no traceback.

Problems that can be seen in the configuration, the data, the model folder or the reward file are
caught before Ray starts (the fast cases, run in-process through ``offstep.cli.main``). A reward
function that misbehaves only shows when it scores real responses: those runs go through Ray, in
pytest's process with the session's Ray (the run must release every worker and pool), and, for a
scorer that hangs, in a subprocess of ``.venv/bin/offstep``, which must exit cleanly, in bounded
time, leaving no process of the run behind.
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
        {
            "data_source": "arithmetic",
            "prompt": [{"role": "user", "content": content}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "2"},
            "extra_info": {"index": i},
        }
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
    path = write(
        tmp / "r.py", "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
    )
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


def _rows_with_ground_truth(tmp, truth, name):
    f = tmp / name
    rows = verl_rows(8)
    for r in rows:
        r["reward_model"]["ground_truth"] = truth
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"data.train_files=[{f}]"]


def _list_ground_truth(tmp):
    return _rows_with_ground_truth(tmp, ["2", "two"], "listgt.jsonl")


def _dict_ground_truth(tmp):
    return _rows_with_ground_truth(tmp, {"answer": "2"}, "dictgt.jsonl")


def _reward_file_exits_on_import(tmp):
    path = write(
        tmp / "exits.py",
        """
        import sys

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.0

        sys.exit(0)
    """,
    )
    return [f"reward.custom_path={path}"]


def _scorer_with_wrong_signature(tmp):
    path = write(tmp / "twoargs.py", "def compute_score(solution_str, ground_truth):\n    return 0.0\n")
    return [f"reward.custom_path={path}"]


def tiny_model_copy(tmp: Path) -> Path:
    """A copy of the tiny model's folder, to damage."""
    import shutil

    from offstep.models.loading import resolve_model

    return Path(shutil.copytree(resolve_model("tiny"), tmp / "model"))


def _corrupt_safetensors(tmp):
    d = tiny_model_copy(tmp)
    weights = d / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + weights.read_bytes()[8:])  # a header length no file has
    return [f"model.path={d}"]


def _output_dir_is_a_file(tmp):
    return [f"trainer.output_dir={write(tmp / 'taken', 'not a directory')}"]


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
    "list ground truth with a built-in scorer": (
        _list_ground_truth,
        ["listgt.jsonl", "row 0", "is a list", "string or number", "reward.custom_path"],
    ),
    "dict ground truth with a built-in scorer": (
        _dict_ground_truth,
        ["dictgt.jsonl", "row 0", "is a dict", "every reward would be 0", "reward.custom_path"],
    ),
    "reward file exits on import": (_reward_file_exits_on_import, ["exits.py", "sys.exit(0)", "__main__"]),
    "scorer with the wrong signature": (
        _scorer_with_wrong_signature,
        [
            "twoargs.py",
            "'compute_score'",
            "compute_score(solution_str, ground_truth)",
            "Fix: define it as def compute_score(data_source, solution_str, ground_truth, extra_info=None",
        ],
    ),
    "corrupt safetensors file": (_corrupt_safetensors, ["model.safetensors", "cannot be read as safetensors", "Fix"]),
    "output dir is a file": (_output_dir_is_a_file, ["trainer.output_dir", "taken", "is an existing file"]),
}

OPTION_CASES = {
    "colocate with off-policy": (
        ["pipeline.colocate=true", "pipeline.max_staleness=1"],
        ["pipeline.colocate", "max_staleness=0"],
    ),
    "grpo with one sample": (["rollout.n=1"], ["rollout.n", "algorithm.adv_estimator"]),
    "batch does not divide": (["actor.mini_batch_size=3"], ["actor.mini_batch_size", "divide"]),
    "unknown key": (
        ["trainer.total_stepz=1"],
        ["unknown configuration key 'trainer.total_stepz'", "did you mean trainer.total_steps"],
    ),
    "wrong type": (["trainer.total_steps=many"], ["bad value for trainer.total_steps", "'many'", "Fix"]),
    "nan learning rate": (["actor.optim.lr=nan"], ["actor.optim.lr", "finite"]),
    "bad nonfinite policy": (["actor.nonfinite=ignore"], ["actor.nonfinite", "skip", "stop"]),
    "bad critic nonfinite policy": (["critic.nonfinite=warn"], ["critic.nonfinite", "skip", "stop"]),
    "zero reward timeout": (["reward.timeout_s=0"], ["reward.timeout_s", "null"]),
    "zero samples per prompt": (["rollout.n=0"], ["rollout.n=0 must be >= 1"]),
    "zero logged samples": (
        ["trainer.log_samples_count=0"],
        ["trainer.log_samples_count=0", "trainer.log_samples_freq=0"],
    ),
    "negative learning rate": (["actor.optim.lr=-1e-3"], ["actor.optim.lr=-0.001", ">= 0"]),
    "beta of one": (["actor.optim.betas=[0.9,1.0]"], ["actor.optim.betas=[0.9, 1.0]", "[0, 1)"]),
    "negative critic beta": (["critic.optim.betas=[-0.1,0.999]"], ["critic.optim.betas", "[0, 1)"]),
    "negative weight decay": (["critic.optim.weight_decay=-0.1"], ["critic.optim.weight_decay=-0.1", ">= 0"]),
    "unknown schedule": (["actor.optim.lr_scheduler_type=wsd"], ["actor.optim.lr_scheduler_type='wsd'", "cosine"]),
    "min lr above lr": (["actor.optim.min_lr_ratio=1.5"], ["actor.optim.min_lr_ratio=1.5", "[0, 1]"]),
    "no cycles": (["critic.optim.num_cycles=0"], ["critic.optim.num_cycles=0", "> 0"]),
    "zero engine batch": (["rollout.max_batch_size=0"], ["rollout.max_batch_size=0", ">= 1"]),
    "zero validation samples": (["rollout.val_n=0"], ["rollout.val_n=0", ">= 1"]),
    "negative validation temperature": (["rollout.val_temperature=-1"], ["rollout.val_temperature=-1.0", ">= 0"]),
    "negative seed": (["trainer.seed=-1"], ["trainer.seed=-1", ">= 0"]),
    "typo added with a plus": (
        ["+trainer.total_step=3"],
        ["unknown configuration key 'trainer.total_step'", "did you mean trainer.total_steps"],
    ),
    "hydra override": (["hydra.run.dir=/tmp/elsewhere"], ["hydra.run.dir", "trainer.output_dir"]),
    "task option without a plus": (
        ["data.task_options.num_operands=3"],
        ["open mapping 'data.task_options'", "+data.task_options.num_operands=VALUE"],
    ),
    "task options given whole without a plus": (
        ["data.task_options={num_operands: 3}"],
        ["open mapping 'data.task_options'", "+data.task_options={KEY: VALUE, ...}"],
    ),
    "unknown task option": (
        ["+data.task_options.bogus=1"],
        ["data.task_options.bogus", "data.task=arithmetic", "digits"],
    ),
    "unset environment variable": (
        ["trainer.wandb_project=${oc.env:OFFSTEP_TEST_NEVER_SET}"],
        ["trainer.wandb_project", "environment variable OFFSTEP_TEST_NEVER_SET", "is not set", "export"],
    ),
    "greedy rollouts for a group estimator": (
        ["rollout.temperature=0"],
        ["rollout.temperature=0", "greedy", "algorithm.adv_estimator=grpo"],
    ),
    "empty output dir": (["trainer.output_dir="], ["trainer.output_dir is empty", "runs/"]),
    "output dir in /sys": (["trainer.output_dir=/sys/offstep_run"], ["trainer.output_dir='/sys/offstep_run'", "/sys"]),
    "vision tower of a text model": (
        ["actor.freeze_vision_tower=true"],
        ["actor.freeze_vision_tower=true", "model.path=tiny is not a vision-language model", "Fix: "],
    ),
    "LoRA on the vision tower only": (
        ["model.path=tiny_vl", "data.task=shapes", "actor.lora.rank=4", "actor.lora.target_modules=[qkv]"],
        ["'qkv' matches no linear layer of the language model (the vision tower gets no adapters)"],
    ),
    "unreachable Ray cluster": (
        ["resources.ray_address=127.0.0.1:1"],
        ["resources.ray_address='127.0.0.1:1'", "ray start --head", "empty"],
    ),
}


def test_read_only_output_dir_is_refused(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    if os.geteuid() == 0:  # root writes anywhere: make the check see what another user would
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **kw: Path(p) != locked and real(p, mode, **kw))
    rc, err = run_cli([*TINY, f"trainer.output_dir={locked / 'run'}"], capsys)
    assert rc == 2 and "Traceback" not in err, err
    assert f"trainer.output_dir='{locked / 'run'}' cannot be created: {locked} is not writable" in err, err


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

def exits(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str:  # the dry call before Ray passes an empty response
        raise SystemExit(0)
    return 0.0
"""

REWARD_CASES = {
    "raises": ["raised KeyError: 'score'", "scorers.py:5", "Fix: make the scorer handle every response"],
    "not_a_number": ["returned a non-number str", "Fix: make the scorer return a finite number"],
    "nan": ["returned a non-finite score nan", "Fix: make the scorer return a finite number"],
    "hangs": ["timed out after 2 s (reward.timeout_s)", "raise reward.timeout_s"],
    "exits": ["called sys.exit(0)", "Fix: make the scorer handle every response"],  # not "worker died"
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
        readers = [
            threading.Thread(target=lambda s=s, k=k: outs[k].append(s.read()), daemon=True)
            for k, s in (("stdout", p.stdout), ("stderr", p.stderr))
        ]
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


def _assert_one_clear_line(err: str, name: str, path: str) -> None:
    assert "Traceback" not in err, err
    line = [ln for ln in err.splitlines() if ln.startswith("offstep: ")]
    assert len(line) == 1, err
    msg = line[0]
    assert "reward for data source 'arithmetic' failed: custom scorer" in msg and path in msg, msg
    for text in REWARD_CASES[name]:
        assert text in msg, (text, msg)


def _held_in_ray(timeout_s: float = 30) -> list[str]:
    """What the run still holds in the session's Ray after ``timeout_s``: placement-group bundles,
    or cores taken by a worker that was not stopped. Empty when every one was released."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        total, free = ray.cluster_resources(), ray.available_resources()
        held = [k for k in total if "_group_" in k]  # a placement group's bundles
        if free.get("CPU", 0) < total.get("CPU", 0):
            held.append(f"CPU: {free.get('CPU', 0)} of {total['CPU']} free")
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(REWARD_CASES) - {"hangs"}))
def test_bad_reward_function_ends_the_run_cleanly(name, tmp_path, capsys, ray_session, monkeypatch):
    """In pytest's process (the session's Ray): the same message as the command's, and the run's
    workers and pools released. A command's own processes: the hanging case below."""
    from offstep.pipeline import controller

    started = []
    real_start = controller.start_workers
    monkeypatch.setattr(controller, "start_workers", lambda *a, **kw: started.append(1) or real_start(*a, **kw))
    path = write(tmp_path / "scorers.py", SCORERS)
    rc, err = run_cli(
        [
            *TINY,
            f"trainer.output_dir={tmp_path / 'run'}",
            f"reward.custom_path={path}",
            f"reward.custom_name={name}",
            "reward.timeout_s=2",
        ],
        capsys,
    )
    assert rc == 2, err
    _assert_one_clear_line(err, name, path)
    assert started, "the run started no worker: it failed before Ray, which is not what this test is for"
    assert not _held_in_ray()


@pytest.mark.ray
@pytest.mark.slow
def test_a_hanging_reward_function_ends_the_command_leaving_no_process(tmp_path):
    """The command, with a scorer stuck in its call: it exits within its time limit, and none of
    the processes it started (Ray's, the workers, the thread stuck in the scorer's) is left."""
    path = write(tmp_path / "scorers.py", SCORERS)
    result, procs = run_and_watch(
        [
            *TINY,
            f"trainer.output_dir={tmp_path / 'run'}",
            f"reward.custom_path={path}",
            "reward.custom_name=hangs",
            "reward.timeout_s=2",
        ]
    )
    assert result.returncode == 2, result.stderr
    _assert_one_clear_line(result.stderr, "hangs", path)
    assert procs, "the run started no process: it failed before Ray, which is not what this test is for"
    deadline = time.monotonic() + 30
    while alive(procs) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive(procs), alive(procs)


@pytest.mark.ray
@pytest.mark.slow
def test_worker_that_fails_to_start_is_named_with_its_cause(tmp_path, capsys, ray_session):
    """Weights that do not fit the model's config pass every check in the driver (which reads no
    tensor) and fail in the workers' from_pretrained: the message names the worker and keeps its
    exception, not "a trainer worker died"."""
    d = tiny_model_copy(tmp_path)
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] *= 2
    (d / "config.json").write_text(json.dumps(config))
    rc, err = run_cli([*TINY, f"trainer.output_dir={tmp_path / 'run'}", f"model.path={d}"], capsys)
    line = [ln for ln in err.splitlines() if ln.startswith("offstep: ")]
    assert rc == 2 and len(line) == 1, err
    assert "the rollout replica 0 worker failed to start: RuntimeError: " in line[0], line[0]
    assert "ignore_mismatched_sizes" in line[0] and "trainer worker died" not in line[0], line[0]
    assert not _held_in_ray()  # the workers that did start, and both pools, were released
