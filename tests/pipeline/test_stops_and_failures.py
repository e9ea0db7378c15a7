"""Stops and failures of a run: Ctrl-C finishes the step and checkpoints; a rollout worker that dies
is replaced; a generation that hangs fails within a bounded time; a trainer worker that dies ends the
run and leaves its last checkpoint intact."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from cli_runs import DYING_REWARD, HANGING_REWARD, SLOW_REWARD, cli, wait_for
from conftest import ENGINES_SLOW_VLLM
from run_records import step_records

from offstep.launch.loader import load_config
from offstep.pipeline.checkpoints import complete_checkpoints


@pytest.mark.ray
@pytest.mark.parametrize("engine", ENGINES_SLOW_VLLM)
def test_sigint_finishes_the_step_writes_a_checkpoint_and_exits(tmp_path, engine):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it): the step in progress
    completes, a checkpoint is written, every process ends (vLLM's included), exit code 130."""
    reward = tmp_path / "slow.py"
    reward.write_text(SLOW_REWARD)
    run = tmp_path / "run"
    args = [
        "preset=tiny",
        f"rollout.engine={engine}",
        f"trainer.output_dir={run}",
        "trainer.total_steps=200",
        "trainer.save_freq=1000",
        "trainer.val_before_train=false",
        "trainer.progress=plain",
        f"reward.custom_path={reward}",
    ]
    proc = cli(args)
    wait_for(run / "metrics.jsonl", proc)
    t0 = time.time()
    while not (run / "metrics.jsonl").read_text().strip() and time.time() - t0 < 300:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err
    assert "stopped at step" in err and "trainer.resume=auto" in err
    found = complete_checkpoints(run / "checkpoints")
    assert found, err
    last_metric = max(step_records(run))
    assert found[-1][0] == last_metric < 200
    # Nothing of the run is left behind (its Ray processes share the session of the driver).
    time.sleep(2)
    leftover = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not leftover, f"processes left running: {leftover}"


@pytest.mark.ray
@pytest.mark.parametrize("engine", ENGINES_SLOW_VLLM)
def test_rollout_worker_death_is_survived_by_a_restart(tmp_path, ray_session, engine):
    """The replica's process dies mid-generation: a new replica (a new vLLM engine, for vLLM) is
    started, given the current weights, and the lost requests are generated again."""
    from offstep.pipeline.controller import train

    reward = tmp_path / "dying.py"
    reward.write_text(DYING_REWARD.replace("MARKER", repr(str(tmp_path / "died"))))
    cfg = load_config(
        [
            "preset=tiny",
            f"rollout.engine={engine}",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.total_steps=3",
            "trainer.val_before_train=false",
            "trainer.progress=off",
            f"reward.custom_path={reward}",
        ]
    )
    history = train(cfg)
    assert (tmp_path / "died").exists(), "the worker was meant to die once"
    assert [m["step"] for m in history if "reward/mean" in m] == [1, 2, 3]
    assert max(m["rollout/staleness_max"] for m in history if "rollout/staleness_max" in m) <= 1


@pytest.mark.ray
@pytest.mark.slow
def test_hung_generation_fails_within_bounded_time(tmp_path, ray_session):
    from offstep.pipeline.controller import train
    from offstep.pipeline.fleet import RolloutFailed

    reward = tmp_path / "hang.py"
    reward.write_text(HANGING_REWARD)
    cfg = load_config(
        [
            "preset=tiny",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.total_steps=2",
            "trainer.val_before_train=false",
            "trainer.progress=off",
            f"reward.custom_path={reward}",
            "rollout.timeout_s=5",
            "rollout.max_restarts=1",
            "reward.timeout_s=3600",
        ]
    )
    t0 = time.time()
    with pytest.raises(RolloutFailed, match="rollout.timeout_s=5.*rollout.max_restarts=1"):
        train(cfg)
    assert time.time() - t0 < 120


@pytest.mark.ray
@pytest.mark.slow
def test_trainer_worker_death_ends_the_run_and_keeps_the_checkpoint(tmp_path):
    """SIGKILL the actor's process mid-run: the run ends (no hang) with a message naming the
    last checkpoint, which stays complete and exportable."""
    import psutil

    from offstep.pipeline.export import export_checkpoint

    reward = tmp_path / "slow.py"
    reward.write_text(SLOW_REWARD)
    run = tmp_path / "run"
    proc = cli(
        [
            "preset=tiny",
            f"trainer.output_dir={run}",
            "trainer.total_steps=200",
            "trainer.save_freq=2",
            "trainer.val_before_train=false",
            "trainer.progress=off",
            f"reward.custom_path={reward}",
        ]
    )
    wait_for(run / "checkpoints" / "step_000002" / "trainer_state.json", proc)
    actors = [
        p
        for p in psutil.process_iter(["cmdline"])
        if "ActorWorker" in " ".join(p.info["cmdline"] or []) and os.getsid(p.pid) == proc.pid
    ]
    assert actors, "the actor worker process was not found"
    for p in actors:
        p.kill()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert "the actor worker died" in err and "is intact: continue with trainer.resume=auto" in err, err
    last = complete_checkpoints(run / "checkpoints")[-1][1]
    assert str(last) in err
    export_checkpoint(last, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").is_file()
