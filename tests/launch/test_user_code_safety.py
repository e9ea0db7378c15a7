"""What a user's files (a reward, tool or agent file, a model's chat template, a dataset) can do to
a command, and cannot: hold it up at exit with a thread, outlive it with a double-forked daemon,
switch off the import time limit (SIGALRM ignored, then an endless loop), hang it in a chat
template's loop, or run it out of memory with a small parquet file of millions of rows.

The commands run as a user runs them (``.venv/bin/offstep`` in a subprocess) where the exit itself
is what is tested; the rest in-process through ``offstep.cli.main``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_bad_input import TINY, no_workers, run_cli, verl_rows  # noqa: F401 (a fixture)

from offstep.cli import main

OFFSTEP = str(Path(sys.executable).with_name("offstep"))
SCORE = "\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n"
THREAD = "import threading, time\nthreading.Thread(target=lambda: time.sleep(3600), name='left-behind').start()\n"
DAEMON = textwrap.dedent("""
    import os, time
    if os.fork() == 0:  # a daemon: fork, leave the session, fork again, the middle one exits
        os.setsid()
        if os.fork() == 0:
            with open(os.environ["DAEMON_PIDS"], "a") as f:
                f.write(f"{os.getpid()}\\n")
            while True:
                time.sleep(1)
        os._exit(0)
""")
DEAF_LOOP = "import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass\n"
NESTED_LOOP = (
    "{% for i in range(99999) %}{% for j in range(99999) %}{{ '' }}{% endfor %}{% endfor %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def offstep(args: list[str], tmp: Path, timeout: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, DAEMON_PIDS=str(tmp / "daemon.pids"))
    t0 = time.monotonic()
    # stdout/stderr to files: a daemon that kept a pipe open would hold up communicate(), not the command
    with open(tmp / "out.txt", "w+") as out, open(tmp / "err.txt", "w+") as err:
        proc = subprocess.run([OFFSTEP, *args], stdout=out, stderr=err, env=env, timeout=timeout)
    proc.stdout, proc.stderr = (tmp / "out.txt").read_text(), (tmp / "err.txt").read_text()
    return proc, time.monotonic() - t0


def eval_with(tmp: Path, reward_code: str, *extra: str) -> tuple[subprocess.CompletedProcess, float, str]:
    """``offstep eval`` of the tiny model scored by a reward file of ``reward_code`` (its path returned)."""
    reward = tmp / "reward.py"
    reward.write_text(reward_code + SCORE)
    data = jsonl(tmp / "val.jsonl", verl_rows(2))
    proc, took = offstep(
        [
            "eval",
            "tiny",
            "--data",
            data,
            "--reward-path",
            str(reward),
            "--max-new-tokens",
            "2",
            "--out",
            str(tmp / "res.json"),
            *extra,
        ],
        tmp,
    )
    return proc, took, str(reward)


def daemons(tmp: Path) -> list[int]:
    f = tmp / "daemon.pids"
    return [int(p) for p in f.read_text().split()] if f.exists() else []


# -------------------------------------------------------------------------------------------------
# a reward file's threads and processes end with the command


@pytest.mark.heavy
def test_eval_exits_although_the_reward_file_left_a_thread(tmp_path):
    proc, took, _ = eval_with(tmp_path, THREAD)
    assert proc.returncode == 0, proc.stderr
    assert "offstep: results in" in proc.stdout
    assert "not waiting for 1 thread(s) still running at exit ('left-behind')" in proc.stderr, proc.stderr
    assert took < 200


@pytest.mark.heavy
def test_a_daemon_the_reward_file_started_ends_with_eval(tmp_path):
    proc, _, _ = eval_with(tmp_path, DAEMON)
    assert proc.returncode == 0, proc.stderr
    pids = daemons(tmp_path)
    assert pids, (
        pids
    )  # the attack ran (the probe's import and the command's own each start one; under load the second may not have written its pid yet)
    assert not [p for p in pids if running(p)], pids


@pytest.mark.heavy
def test_an_import_that_ignores_sigalrm_is_cut_off(tmp_path):
    proc, took, reward = eval_with(tmp_path, DEAF_LOOP, "--reward-timeout", "2")
    assert proc.returncode == 2, proc.stderr
    assert f"--reward-path={reward} did not finish importing within 2 s (--reward-timeout)" in proc.stderr
    assert "raise --reward-timeout" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert took < 120


@pytest.mark.heavy
def test_files_that_ignore_sigalrm_are_refused_in_process(tmp_path):
    """The probe process is what times out: this process never runs the file's loop."""
    from offstep.rewards.registry import RewardConfigError, RewardFunction
    from offstep.rollout.agents.tools import ToolConfigError, load_tools

    deaf = tmp_path / "deaf.py"
    deaf.write_text(DEAF_LOOP + SCORE)
    t0 = time.monotonic()
    with pytest.raises(RewardConfigError, match="did not finish importing within 1 s"):
        RewardFunction(str(deaf), timeout_s=1).check_sources(["src"])
    with pytest.raises(ToolConfigError, match="did not finish importing within 1 s"):
        load_tools(str(deaf), ["compute_score"], timeout_s=1)
    assert time.monotonic() - t0 < 30


@pytest.mark.ray
@pytest.mark.slow
def test_train_ends_the_threads_and_daemons_of_the_reward_file(tmp_path):
    """In train the file is imported by the driver and again in the Ray workers that score."""
    reward = tmp_path / "both.py"
    reward.write_text(THREAD + DAEMON + SCORE)
    proc, _ = offstep(
        [
            "train",
            *TINY,
            "trainer.total_steps=1",
            f"trainer.output_dir={tmp_path / 'run'}",
            f"reward.custom_path={reward}",
        ],
        tmp_path,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "offstep: done" in proc.stdout
    pids = daemons(tmp_path)
    assert len(pids) >= 3, pids  # the probe's, the driver's and at least one worker's
    assert not [p for p in pids if running(p)], pids


# -------------------------------------------------------------------------------------------------
# chat templates


@pytest.mark.heavy
def test_a_chat_template_that_loops_for_ever_is_refused(tmp_path, capsys):
    from offstep.models.loading import resolve_model

    model = Path(shutil.copytree(resolve_model("tiny"), tmp_path / "model"))
    (model / "chat_template.jinja").write_text(NESTED_LOOP)
    data = jsonl(tmp_path / "val.jsonl", verl_rows(2))
    t0 = time.monotonic()
    capsys.readouterr()
    rc = main(["eval", str(model), "--data", data, "--max-new-tokens", "2", "--out", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"the chat template ({model / 'chat_template.jinja'}) did not finish rendering" in err, err
    assert "within 5 s" in err and "Fix: repair the template" in err, err
    assert time.monotonic() - t0 < 60


@pytest.mark.heavy
def test_a_template_that_loops_on_one_row_names_the_row():
    from types import SimpleNamespace

    from offstep.data.render import render_all
    from offstep.errors import DatasetError

    class Tok:
        name_or_path = ""

        def apply_chat_template(self, messages, **kwargs):
            while messages[-1]["content"] == "loop":  # what a template's loop over the content does
                pass
            return messages[-1]["content"]

    rows = [
        SimpleNamespace(
            messages=[{"role": "user", "content": c}], index=i, data_source="src", agent_name="single_turn_agent"
        )
        for i, c in enumerate(["a", "b", "loop", "c"])
    ]
    assert render_all(Tok(), rows[:2], limit_s=5) == ["a", "b"]
    with pytest.raises(DatasetError, match=r"'src' row 2: the chat template \(the tokenizer\) did not finish"):
        render_all(Tok(), rows, limit_s=0.3)


# -------------------------------------------------------------------------------------------------
# datasets


def _row_bomb(path: Path, rows: int) -> str:
    """A parquet file of ``rows`` identical rows that fits in a few hundred KB (dictionary-encoded)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def same(value):
        return pa.repeat(pa.scalar(value), rows).dictionary_encode()

    pq.write_table(
        pa.table({"data_source": same("arithmetic"), "prompt": same("What is 1 + 1?"), "answer": same("2")}),
        path,
        compression="zstd",
    )
    return str(path)


@pytest.mark.heavy
def test_a_small_parquet_file_of_millions_of_rows_is_refused_unread(tmp_path, capsys, monkeypatch, no_workers):
    import pyarrow.parquet as pq

    bomb = _row_bomb(tmp_path / "bomb.parquet", 20_000_000)
    assert os.path.getsize(bomb) < 1_000_000

    def unread(*a, **k):
        raise AssertionError("the rows were read")

    monkeypatch.setattr(pq, "read_table", unread)
    capsys.readouterr()
    rc = main(["eval", "tiny", "--data", bomb, "--answer-key", "answer", "--out", str(tmp_path / "o.json")])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"{bomb}: 20,000,000 rows" in err and "over --max-rows=10,000,000" in err, err
    assert "Fix: give a file with fewer rows" in err and "raise --max-rows (0: no limit)" in err, err
    rc, err = run_cli(
        [*TINY, f"trainer.output_dir={tmp_path / 'run'}", f"data.train_files=[{bomb}]", "data.answer_key=answer"],
        capsys,
    )
    assert rc == 2 and "over data.max_rows=10,000,000" in err and "raise data.max_rows" in err, err


def test_row_limit_of_parquet_and_jsonl(tmp_path):
    from offstep.data.dataset import load_records
    from offstep.errors import DatasetError

    small = _row_bomb(tmp_path / "small.parquet", 5)
    assert len(load_records(small, answer_key="answer", max_rows=5)) == 5
    with pytest.raises(DatasetError, match="5 rows .* over data.max_rows=4"):
        load_records(small, answer_key="answer", max_rows=4)
    lines = jsonl(tmp_path / "rows.jsonl", verl_rows(3))
    assert len(load_records(lines, max_rows=0)) == 3  # 0: no limit
    with pytest.raises(DatasetError, match="3 rows .* over data.max_rows=2"):
        load_records(lines, max_rows=2)


def test_running_out_of_memory_while_reading_says_so(tmp_path, monkeypatch):
    """Not "re-create the file" or "re-write it with plain columns": nothing is wrong with it."""
    import pyarrow.parquet as pq

    from offstep.data.dataset import load_records
    from offstep.errors import DatasetError

    small = _row_bomb(tmp_path / "small.parquet", 5)

    class Table:  # what pyarrow returns, but out of memory when its rows become Python values
        column_names = ["data_source", "prompt", "answer"]

        def to_pylist(self):
            raise MemoryError()

    monkeypatch.setattr(pq, "read_table", lambda path: Table())
    with pytest.raises(DatasetError) as info:
        load_records(small, answer_key="answer")
    msg = str(info.value)
    assert "ran out of memory while reading its rows (5 rows" in msg and "Fix: give a file with fewer rows" in msg
    assert "re-write" not in msg and "re-create" not in msg, msg
