"""Console modes (plain has no control characters), ETA, live progress through a real hub actor
and the worker hooks, and the W&B logger in offline mode."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import re

import pytest

from offstep.launch.loader import ConfigError, load_config
from offstep.telemetry.console import ConsoleProgress, auto_mode, eta_seconds, format_duration, plain_text, step_line
from offstep.telemetry.loggers import RunLoggers, WandbLogger, resolve_wandb_mode
from offstep.telemetry.metrics import read_jsonl
from offstep.telemetry.names import Actor, Perf, Reward, Role, Stage, Timing, Val, replica
from offstep.telemetry.progress import (
    LiveStatus,
    ProgressClient,
    format_status,
    latest,
    launch_hub,
    mini_batch_count,
)

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


# ---------------------------------------------------------------- pure helpers
def test_eta_is_median_step_time_times_steps_left():
    # median(12, 30, 10) = 12 s; 5 steps left -> 60 s
    assert eta_seconds([12.0, 30.0, 10.0], 5) == 60.0
    # median(10, 20) = 15 s; 3 steps left -> 45 s
    assert eta_seconds([10.0, 20.0], 3) == 45.0
    assert eta_seconds([], 3) is None
    assert eta_seconds([5.0], 0) == 0.0


def test_format_duration():
    assert format_duration(None) == "?"
    assert format_duration(42.4) == "42s"
    assert format_duration(59.6) == "1m00s"  # rounds to 60 s
    assert format_duration(185) == "3m05s"  # 3 x 60 + 5
    assert format_duration(3720) == "1h02m"  # 3600 + 2 x 60
    assert format_duration(0) == "0s"


def test_step_line_has_throughput_and_eta():
    m = {"step": 2, Reward.MEAN: 0.5, Timing.STEP: 4.0, Perf.TOKENS_PER_S: 812.3, Perf.SAMPLES_PER_S: 8.0}
    assert step_line(m, 45.0) == "step    2 | reward 0.500 | step 4.0s | tok/s 812 | smp/s 8.00 | eta 45s"


def test_mini_batch_count():
    # 10 local samples, mini-batches of 4 -> 4 + 4 + 2 = 3 mini-batches, x 2 epochs = 6
    assert mini_batch_count(10, 4, 2) == 6
    assert mini_batch_count(8, 0, 1) == 1  # 0: the whole batch
    assert mini_batch_count(8, 8, 3) == 3


def test_format_status_orders_roles_and_shows_counts():
    states = {
        replica(10): {"stage": Stage.GEN, "done": 1, "total": 2, "version": 3},
        replica(2): {"stage": Stage.LOAD_WEIGHTS, "version": 4},
        Role.TRAINER: {"stage": Stage.UPDATE_ACTOR, "done": 3, "total": 8, "mini": 2, "minis": 3},
    }
    assert format_status(states, step=5) == (
        "step 5 | trainer update_actor 3/8 (mini-batch 2/3) | rollout/2 load_weights v4 | rollout/10 gen v3 1/2"
    )
    assert format_status({}) == ""


def test_latest_keeps_newest_record_per_role():
    hub = {Role.TRAINER: {"stage": Stage.UPDATE_ACTOR, "t": 10.0}, replica(0): {"stage": Stage.GEN, "t": 9.0}}
    notes = {Role.TRAINER: {"stage": Stage.SYNC, "t": 11.0}, replica(0): {"stage": "wait", "t": 8.0}}
    merged = latest(hub, notes)
    assert merged[Role.TRAINER]["stage"] == Stage.SYNC and merged[replica(0)]["stage"] == Stage.GEN


# ---------------------------------------------------------------- console
def test_plain_console_prints_no_control_characters():
    out = _Stream(tty=False)
    con = ConsoleProgress(total=4, mode="auto", status_interval_s=1e-9, stream=out)
    assert con.mode == "plain" and con.progress is None
    con.log("offstep: \x1b[31mred\x1b[0m\rback")
    con.status("step 1 | trainer update_actor 1/2")
    con.step({"step": 1, Reward.MEAN: 0.25, Timing.STEP: 10.0})
    con.step({"step": 2, Reward.MEAN: 0.5, Timing.STEP: 20.0})
    con.close()
    text = out.getvalue()
    assert not CONTROL.search(text), repr(text)
    lines = text.splitlines()
    assert lines[0] == "offstep: [31mred[0mback"
    assert lines[1].startswith("status | step 1 | trainer update_actor 1/2 | elapsed ")
    assert lines[2] == "step    1 | reward 0.250 | step 10.0s | eta 30s"  # median 10 s x 3 left
    assert lines[3] == "step    2 | reward 0.500 | step 20.0s | eta 30s"  # median 15 s x 2 left


def test_plain_status_lines_are_rate_limited():
    out = _Stream(tty=False)
    con = ConsoleProgress(total=4, mode="plain", status_interval_s=3600, stream=out)
    for i in range(20):
        con.status(f"step 1 | rollout/0 gen v0 {i}/20")
    assert out.getvalue() == ""  # nothing printed within the interval
    con.step({"step": 1, Timing.STEP: 1.0})
    assert len(out.getvalue().splitlines()) == 1


def test_a_falling_entropy_is_warned_once():
    out = _Stream(tty=False)
    con = ConsoleProgress(total=9, mode="plain", status_interval_s=3600, stream=out)
    # 2.0 at step 1: 0.6 is 30% of it (no warning), 0.48 is 24% (warned), 0.1 later: not again
    for step, e in [(0, None), (1, 2.0), (2, 1.2), (3, 0.6), (4, 0.48), (5, 0.1)]:
        con.step({"step": step, Timing.STEP: 1.0, **({} if e is None else {Actor.ENTROPY: e})})
    warnings = [line for line in out.getvalue().splitlines() if "collapsing" in line]
    assert warnings == [warnings[0]] and "from 2 to 0.48 nats per token by step 4" in warnings[0]
    assert "docs/running.md" in warnings[0]


def test_off_prints_nothing():
    out = _Stream(tty=True)
    con = ConsoleProgress(total=2, mode="off", stream=out)
    con.log("x")
    con.status("y")
    con.step({"step": 1, Timing.STEP: 1.0})
    assert out.getvalue() == ""


def test_auto_mode(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    assert auto_mode(_Stream(tty=True)) == "bar"
    assert auto_mode(_Stream(tty=False)) == "plain"
    monkeypatch.setenv("CI", "true")
    assert auto_mode(_Stream(tty=True)) == "plain"
    monkeypatch.delenv("CI")
    monkeypatch.setenv("TERM", "dumb")
    assert auto_mode(_Stream(tty=True)) == "plain"


def test_bar_mode_shows_live_status_and_eta():
    out = _Stream(tty=True)
    con = ConsoleProgress(total=4, mode="bar", stream=out)
    con.console.width = 60
    con.step({"step": 1, Timing.STEP: 10.0})
    con.status("step 2 | trainer update_actor 3/8 | rollout/0 gen v1 17/32 | rollout/1 gen v1 9/32")
    task = con.progress.tasks[0]
    assert task.completed == 1 and task.fields["eta"] == "30s"  # 10 s x 3 steps left
    con.progress.refresh()
    con.close()
    screen = re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", out.getvalue())
    assert "step    1 | step 10.0s | eta 30s" in screen
    assert "1/4" in screen and "eta 30s" in screen
    # the status has a line of its own, cut to the terminal's width
    status = [line for line in screen.split("\n") if line.startswith("  step 2 | trainer update_actor 3/8 | ")]
    assert status and len(status[-1]) == 60 and status[-1].endswith("…"), status


def test_plain_text_strips_controls_only():
    assert plain_text("a\tb\x07c\x1b[0m\u00e9\u0085") == "a\tbc[0m\u00e9"


# ---------------------------------------------------------------- W&B and the run's loggers
def test_resolve_wandb_mode():
    assert resolve_wandb_mode("", {}) == "offline"  # no account needed by default
    assert resolve_wandb_mode("", {"WANDB_MODE": "disabled"}) == "disabled"
    assert resolve_wandb_mode("online", {"WANDB_MODE": "offline"}) == "online"  # the config wins
    with pytest.raises(ValueError, match="WANDB_MODE"):
        resolve_wandb_mode("", {"WANDB_MODE": "sometimes"})


def _wandb_run_dir(out):
    import wandb

    wandb.teardown()  # the W&B service writes the run file asynchronously; this flushes it (as exit does)
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


@pytest.mark.heavy
def test_wandb_offline_writes_run_with_metrics_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    logger = WandbLogger(tmp_path, {"trainer": {"total_steps": 2}}, "offstep-test", "unit", "")
    rows = [{"step": 2, "version": 1, "prompt": "What is 2+3?", "response": "5", "reward": 1.0}]
    logger.log_samples(2, rows)  # the controller logs step 2's samples before step 1's metrics
    logger.log({"step": 1, Actor.PG_LOSS: 0.123456, Reward.MEAN: 0.25, Val.POLICY_VERSION: 0})
    assert list(logger._samples) == [2]  # held back until step 2's metrics
    logger.log({"step": 2, Actor.PG_LOSS: 0.654321, Reward.MEAN: 0.75})
    assert not logger._samples
    logger.close()
    run = _wandb_run_dir(tmp_path)
    data = next(run.glob("run-*.wandb")).read_bytes()
    for key in (Actor.PG_LOSS.encode(), Reward.MEAN.encode(), b"0.123456", b"0.654321"):
        assert key in data, key
    # W&B drops a record logged at a lower step than one before it: both steps' values are there
    tables = list(run.glob("files/media/table/samples_*.table.json"))
    assert len(tables) == 1
    assert "What is 2+3?" in tables[0].read_text()


@pytest.mark.heavy
def test_run_loggers_fan_out(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(
        ["preset=tiny", f"trainer.output_dir={tmp_path}", "trainer.loggers=[console,jsonl,tensorboard,wandb]"]
    )
    logs = RunLoggers(tmp_path, cfg)
    logs.log_samples(1, [{"step": 1, "version": 0, "prompt": "p", "response": "r", "reward": 0.0}])
    logs.log({"step": 1, Reward.MEAN: 0.5})
    logs.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, Reward.MEAN: 0.5}]
    assert read_jsonl(tmp_path / "samples.jsonl")[0]["prompt"] == "p"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert Reward.MEAN.encode() in next(_wandb_run_dir(tmp_path).glob("run-*.wandb")).read_bytes()


def test_config_checks_for_telemetry_keys():
    from offstep.launch.preflight import validate

    for override, key in (
        ("trainer.wandb_mode=sometimes", "trainer.wandb_mode"),
        ("trainer.status_interval_s=-1", "trainer.status_interval_s"),
        ("trainer.loggers=[console,wandbb]", "trainer.loggers"),
    ):
        with pytest.raises(ConfigError, match=re.escape(key)):
            validate(load_config(["preset=tiny", override]))
    validate(load_config(["preset=tiny", "trainer.loggers=[console,jsonl,wandb]", "trainer.wandb_mode=offline"]))


# ---------------------------------------------------------------- the hub, with real Ray actors
@pytest.mark.ray
def test_hub_counts_and_rate_limits(ray_session):
    import ray

    hub = launch_hub()
    try:
        # This process is the only caller: its calls reach the hub in submission order.
        client = ProgressClient(hub, replica(0), min_interval_s=3600)
        client.start(Stage.GEN, total=5, version=2)
        for _ in range(3):
            client.advance()
        snap = ray.get(hub.snapshot.remote())
        assert snap[replica(0)]["done"] == 0  # rate-limited: only the start went out
        client.advance(2)  # completes the stage: always sent
        st = ray.get(hub.snapshot.remote())[replica(0)]
        assert (st["stage"], st["done"], st["total"], st["version"]) == (Stage.GEN, 5, 5, 2)
        ProgressClient(None, Role.TRAINER).start(Stage.UPDATE_ACTOR, total=3)  # no hub: a no-op

        out = _Stream(tty=False)
        live = LiveStatus(ConsoleProgress(total=10, mode="plain", status_interval_s=1e-9, stream=out), hub)
        live.note(Role.TRAINER, Stage.SYNC, step=4)
        asyncio.run(live.poll_once())
        assert out.getvalue().splitlines()[-1].startswith("status | step 4 | trainer sync | rollout/0 gen v2 5/5 |")
    finally:
        ray.kill(hub)


@pytest.fixture
def tiny_inputs(tmp_path):
    from offstep.pipeline.inputs import prepare_inputs

    cfg = load_config(
        ["preset=tiny", f"trainer.output_dir={tmp_path}", "actor.mini_batch_size=16", "actor.micro_batch_size=4"]
    )
    return cfg, prepare_inputs(cfg, tmp_path)


@pytest.mark.ray
def test_worker_hooks_report_samples_and_micro_batches(tiny_inputs, ray_session):
    """A real rollout worker and actor, in this process, pushing to a real hub actor."""
    import ray
    import torch

    from offstep.algos.advantages import grpo_outcome_advantage
    from offstep.batch import collate
    from offstep.pipeline.inputs import to_request
    from offstep.rollout.replica_spec import RolloutSpec
    from offstep.rollout.types import SamplingParams
    from offstep.rollout.worker import RolloutWorker
    from offstep.train.actor import ActorWorker
    from offstep.train.distributed import GroupSpec

    cfg, inputs = tiny_inputs
    r = cfg.rollout
    hub = launch_hub()
    actor = None
    try:
        rollout = RolloutWorker(
            RolloutSpec.local(inputs.model_path, inputs.reward, r.max_batch_size),
            progress=ProgressClient(hub, replica(0)),
        )
        reqs = [to_request(p, i) for i, p in enumerate(inputs.train[:8])]
        params = SamplingParams(n=4, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=r.max_new_tokens)
        samples, _ = rollout.generate(reqs, params, 0)
        st = ray.get(hub.snapshot.remote())[replica(0)]
        assert (st["stage"], st["done"], st["total"], st["version"]) == (Stage.GEN, 32, 32, 0)

        spec = GroupSpec(0, 1, "127.0.0.1", 0, "cpu", 1)
        fixed_count = dataclasses.replace(cfg.actor, micro_token_budget=0)  # micro-batches of micro_batch_size rows
        actor = ActorWorker(
            spec,
            0,
            inputs.model_path,
            "float32",
            "float32",
            fixed_count,
            cfg.algorithm,
            r.temperature,
            ProgressClient(hub, Role.TRAINER),
        )
        batch = collate(samples, inputs.pad_id)
        batch.advantages, batch.returns = grpo_outcome_advantage(batch.scores, batch.group_ids, batch.response_mask)
        actor.update(batch)
        st = ray.get(hub.snapshot.remote())[Role.TRAINER]
        # 32 samples in mini-batches of 16: 2 mini-batches; micro-batches of 4 rows: 4 + 4 = 8.
        assert (st["stage"], st["done"], st["total"], st["mini"], st["minis"]) == (Stage.UPDATE_ACTOR, 8, 8, 2, 2)
    finally:
        if actor is not None:
            actor.shutdown()
        torch.set_num_threads(max(1, torch.get_num_threads()))
        ray.kill(hub)


# ---------------------------------------------------------------- a whole run, as CI sees it
@pytest.mark.ray
def test_plain_run_has_status_throughput_eta_and_wandb(tmp_path, ray_session, capsys, monkeypatch):
    """A tiny run with stdout captured (not a terminal): plain lines only, the driver's stage
    notes as status lines, throughput and ETA in the step lines, an offline W&B run."""
    import offstep.pipeline.controller as controller

    monkeypatch.delenv("WANDB_MODE", raising=False)
    cfg = load_config(
        [
            "preset=tiny",
            "trainer.total_steps=3",
            f"trainer.output_dir={tmp_path}",
            "trainer.progress=auto",
            "trainer.status_interval_s=0.001",
            "trainer.loggers=[console,jsonl,wandb]",
            "trainer.val_before_train=false",
        ]
    )
    controller.train(cfg)
    out = capsys.readouterr().out
    assert not CONTROL.search(out), repr(out)
    assert re.search(r"^status \| step 1 \| trainer wait_gen \| .*elapsed \S+ \| eta \?$", out, re.M), out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 3, out
    assert all("tok/s" in s and "smp/s" in s for s in steps)
    assert "eta" in steps[0] and "eta" in steps[1] and "eta" not in steps[2]  # nothing left after the last
    metrics = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if m["step"] >= 1]
    assert all(m[Perf.SAMPLES_PER_S] > 0 for m in metrics)
    assert Perf.SAMPLES_PER_S.encode() in next(_wandb_run_dir(tmp_path).glob("run-*.wandb")).read_bytes()
