"""Bad input whose message comes from inside the run, checked in-process: a reward function's own
errors (the scorer's line, values beyond float32, exits off the main thread, the dry call), the
reward timeout of ``offstep eval``, torn or corrupt metrics files, and a worker's failure as Ray
reports it. The entry-point cases are in tests/launch/test_bad_input.py."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from test_bad_input import TINY, verl_rows, write

from offstep.cli import main

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


def test_scorer_exit_and_interrupt_off_the_main_thread_are_scorer_errors(tmp_path):
    """A scorer's sys.exit() or KeyboardInterrupt in a scoring thread (where the rollout worker
    scores) must not end the process: it is a RewardError like any other exception."""
    from offstep.rewards.registry import RewardError, RewardFunction

    path = write(
        tmp_path / "s.py",
        """
        def exits(data_source, solution_str, ground_truth, extra_info=None):
            raise SystemExit(3)

        def interrupts(data_source, solution_str, ground_truth, extra_info=None):
            raise KeyboardInterrupt
    """,
    )
    errors = []

    def score(name):
        try:
            RewardFunction(path, name)("src", "x", "1", {"index": 7})
        except RewardError as e:
            errors.append(str(e))

    for name in ("exits", "interrupts"):
        t = threading.Thread(target=score, args=(name,))
        t.start()
        t.join()
    assert len(errors) == 2, errors
    assert "called sys.exit(3)" in errors[0] and "s.py:3" in errors[0] and "extra_info index 7" in errors[0], errors[0]
    assert "raised KeyboardInterrupt at" in errors[1], errors[1]


def test_dry_call_is_fatal_only_for_arguments_that_do_not_fit(tmp_path):
    """The dry call before Ray uses an empty response: a scorer that cannot handle that (ValueError,
    a TypeError inside its body, a bad result) is not wrong for real responses, so only a call whose
    arguments do not fit its parameters fails."""
    from offstep.rewards.registry import RewardConfigError, RewardFunction

    path = write(
        tmp_path / "s.py",
        """
        def parses(data_source, solution_str, ground_truth, extra_info=None):
            return float(solution_str)  # ValueError on ""

        def inner_type_error(data_source, solution_str, ground_truth, extra_info=None):
            return len(None) if not solution_str else 1.0

        def returns_none(data_source, solution_str, ground_truth, extra_info=None):
            return None

        def no_extra_info(data_source, solution_str, ground_truth):
            return 1.0
    """,
    )
    for name in ("parses", "inner_type_error", "returns_none"):
        RewardFunction(path, name).check_call("src", "1", {"index": 0})
    with pytest.raises(RewardConfigError, match="unexpected keyword argument 'extra_info'.*Fix: define it as"):
        RewardFunction(path, "no_extra_info").check_call("src", "1", {"index": 0})


def test_eval_reward_timeout_names_the_flag_and_the_sample(tmp_path, capsys):
    scorer = write(
        tmp_path / "slow.py",
        """
        import time

        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            time.sleep(3600)
    """,
    )
    data = tmp_path / "val.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in verl_rows(2)))
    capsys.readouterr()
    rc = main(
        [
            "eval",
            "tiny",
            "--data",
            str(data),
            "--reward-path",
            scorer,
            "--reward-timeout",
            "0.5",
            "--max-new-tokens",
            "2",
            "--out",
            str(tmp_path / "out.json"),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert "timed out after 0.5 s (--reward-timeout)" in err and "Sample (first 200 chars)" in err, err
    assert "raise --reward-timeout" in err, err


def test_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, caplog):
    from offstep.telemetry.metrics import truncate_jsonl

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "reward/mean": 0.')  # crashed mid-write
    truncate_jsonl(f, 2)
    assert f.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert str(f) in caplog.text and "line 3" in caplog.text


def test_truncation_replaces_the_file_whole(tmp_path, monkeypatch):
    """A resumed run rewrites its records (a kill can land there): until the new file replaces the
    old one in a single rename, the old one is there in full."""
    import offstep.files as files
    import offstep.telemetry.metrics as metrics

    f = tmp_path / "timeline.jsonl"
    f.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')

    def killed(src, dst):
        assert Path(src).read_text() == '{"step": 1}\n'  # the kept records, written in full
        raise KeyboardInterrupt  # the process dies here

    monkeypatch.setattr(files.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        metrics.truncate_jsonl(f, 1)
    assert f.read_text() == '{"step": 1}\n{"step": 2}\n{"step": 3}\n'
    monkeypatch.undo()
    metrics.truncate_jsonl(f, 1)  # the next start's truncation (its leftover .tmp written over)
    assert f.read_text() == '{"step": 1}\n' and [p.name for p in tmp_path.iterdir()] == ["timeline.jsonl"]


def test_corrupt_metrics_line_in_the_middle_is_an_error(tmp_path):
    from offstep.errors import OffstepError
    from offstep.telemetry.metrics import truncate_jsonl

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')
    with pytest.raises(OffstepError, match=r"metrics.jsonl: line 2 is not a JSON object.*Fix"):
        truncate_jsonl(f, 3)
    assert f.read_text().count("\n") == 3  # left as it was


# Ray's text of a worker whose constructor raised, and of one whose process died (Ray 2.x)
INIT_FAILED = (
    "The actor died because of an error raised in its creation task, \x1b[36mray::RolloutWorker.__init__()\x1b[39m "
    "(pid=1, ip=10.0.0.1, actor_id=ab, repr=<RolloutWorker>)\n"
    "  File \"/x/offstep/rollout/worker.py\", line 65, in __init__\n    model = load_causal_lm(model_path)\n"
    "            ^^^^^^^^^^^^^^^^^^^^^^^^\nsafetensors_rust.SafetensorError: Error while deserializing header: header too large"
)
DIED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: ActorWorker\n\tactor_id: ab\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) ..."
)


@pytest.mark.parametrize(
    "text, init_failed, role, expected",
    [
        (
            INIT_FAILED,
            True,
            None,
            [
                "RolloutFailed",
                "the rollout replica worker failed to start: safetensors_rust."
                "SafetensorError: Error while deserializing header: header too large",
            ],
        ),
        (
            INIT_FAILED.replace("RolloutWorker", "ActorWorker"),
            True,
            "actor rank 0",
            ["TrainerFailed", "the actor rank 0 worker failed to start: safetensors_rust.SafetensorError"],
        ),
        (
            DIED,
            False,
            None,
            [
                "TrainerFailed",
                "the actor worker died: The actor died unexpectedly",
                "worker exit type: SYSTEM_ERROR",
                "no checkpoint was written",
            ],
        ),
    ],
)
def test_worker_failure_keeps_the_cause_and_names_the_role(text, init_failed, role, expected, tmp_path):
    """controller.train turns Ray's actor errors into one line: the role, and the worker's own
    exception (not Ray's banner or the traceback)."""
    import ray

    from offstep.errors import OffstepError
    from offstep.launch.loader import load_config
    from offstep.pipeline.controller import train

    def start(cfg, inputs, console):
        e = ray.exceptions.RayActorError(error_msg=text, actor_init_failed=init_failed)
        if role:
            e.role = role  # what Workers.ready sets
        raise e

    cfg = load_config([*TINY, f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(OffstepError) as info:
        train(cfg, start=start)
    msg = f"{type(info.value).__name__} {info.value}"
    for text_ in expected:
        assert text_ in msg, (text_, msg)
    assert "File " not in msg and "^^^" not in msg and "\x1b" not in msg and "Some common causes" not in msg, msg
