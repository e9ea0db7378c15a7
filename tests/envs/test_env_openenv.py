"""OpenEnv environments trained unchanged (offstep.envs.openenv_env, docs/environments.md): an
environment written with openenv-core's server API (examples/environments/oe_arith: no OpenEnv
package on PyPI runs without a container or a hub download) served by a pool of local servers
that offstep starts, resets, steps and stops; offstep's agent loop turns observations into chat
turns through the replica's endpoint. Failures: every third step raises and one hangs past
env.timeout_s, with env.on_error=retry and drop."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from offstep.launch.loader import load_config
from offstep.telemetry.metrics import read_jsonl

pytest.importorskip("openenv.core.env_server.http_server")
EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples" / "environments")
ENV = ["env.kind=openenv", "env.id=oe_arith:ArithEnvironment", f"env.path=[{EXAMPLES}]", "+env.args.size=16"]


def run_args(out: Path, *extra: str) -> list[str]:
    return [
        "preset=tiny",
        "trainer.total_steps=2",
        f"trainer.output_dir={out}",
        "trainer.progress=off",
        "trainer.val_before_train=false",
        "trainer.val_freq=0",
        "rollout.max_new_tokens=12",
        "pipeline.max_staleness=1",
        *ENV,
        *extra,
    ]


def test_action_and_observation_mapping():
    from offstep.envs.openenv_env import action_field, observation_text

    schema = {"properties": {"answer": {"type": "string"}, "metadata": {"type": "object"}}}
    assert action_field(schema, "x:Y") == "answer"
    with pytest.raises(ValueError, match="action_field"):
        action_field({"properties": {"a": {"type": "string"}, "b": {"type": "string"}}}, "x:Y")
    assert observation_text({"prompt": "2+2?", "done": False}, None) == "2+2?"
    assert observation_text({"board": [1], "reward": 1.0, "done": True}, None) == '{"board": [1]}'
    assert observation_text({"board": [1]}, "board") == "[1]"


@pytest.mark.heavy
def test_a_server_that_fails_to_start_is_refused_with_its_error(tmp_path):
    from offstep.envs.rows import EnvLoadError
    from offstep.pipeline.env_inputs import env_inputs

    with pytest.raises(EnvLoadError, match="no attribute 'NoSuchEnvironment'"):
        env_inputs(load_config(run_args(tmp_path, "env.id=oe_arith:NoSuchEnvironment")))
    with pytest.raises(EnvLoadError, match="fully_async"):
        env_inputs(load_config(run_args(tmp_path, "env.on_error=drop", "pipeline.mode=fully_async")))


def servers_of(record: Path) -> list[tuple[int, int]]:
    """(pid, port) of each server, as the environment logged them (once per environment it built)."""
    lines = [x.split() for x in record.read_text().splitlines() if x.startswith("server ")]
    return sorted({(int(x[1]), int(x[2])) for x in lines})


def assert_gone(servers: list[tuple[int, int]]) -> None:
    """Every server process ended and its port closed (a killed worker's servers exit within a second)."""
    deadline = time.time() + 15

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while time.time() < deadline and any(alive(p) for p, _ in servers):
        time.sleep(0.2)
    assert not [p for p, _ in servers if alive(p)]
    ports = {port for _, port in servers}
    # A port may be taken again by another process once its server is gone (tests run side by side):
    # what must be gone is a listener that is an environment server.
    held = [
        (c.laddr.port, c.pid)
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN
        and c.laddr
        and c.laddr.port in ports
        and c.pid
        and "openenv_server" in " ".join(_cmdline(c.pid))
    ]
    assert not held, f"environment servers still listening: {held}"


def failures_of(record: Path) -> tuple[int, int]:
    lines = record.read_text().splitlines()
    return sum(x.startswith("error") for x in lines), sum(x.startswith("hang") for x in lines)


@pytest.mark.ray
@pytest.mark.slow
def test_openenv_trains_retries_failures_and_stops_its_servers(tmp_path, ray_session):
    """Every third step raises and the 4th hangs: each counted (env/errors, env/timeouts: as many as
    the environment logged), retried in a fresh episode; two steps trained; after ``train`` returns
    no server process or port is left."""
    from offstep.pipeline.controller import train

    out, record = tmp_path / "run", tmp_path / "record"
    train(
        load_config(
            run_args(
                out,
                "data.train_batch_size=2",
                "rollout.n=2",
                f"+env.args.record={record}",
                "+env.args.fail_every=3",
                "+env.args.hang_at=4",
                "env.timeout_s=25",
                "env.retries=3",
            )
        )
    )
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]
    errors, hangs = failures_of(record)
    assert errors >= 1 and hangs == 1
    assert sum(m["env/errors"] for m in metrics) == errors and sum(m["env/timeouts"] for m in metrics) == hangs
    assert all(m["env/dropped_groups"] == 0 and m["agent/prefix_breaks"] == 0 for m in metrics)
    servers = servers_of(record)
    assert len(servers) >= 2  # the driver's (its prompts) and the replica's pool
    assert_gone(servers)


@pytest.mark.ray
def test_openenv_trains_fully_async_and_stops_its_servers(tmp_path, ray_session):
    """pipeline.mode=fully_async: the stream plays the episodes; two steps trained, every sample an
    episode's (the agent loop's turns recorded), no server left after ``train`` returns."""
    from offstep.pipeline.controller import train

    out, record = tmp_path / "run", tmp_path / "record"
    train(
        load_config(
            run_args(
                out, "pipeline.mode=fully_async", "data.train_batch_size=2", "rollout.n=2", f"+env.args.record={record}"
            )
        )
    )
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["env/errors"] == 0 and m["env/timeouts"] == 0 for m in metrics), metrics
    servers = servers_of(record)
    assert len(servers) >= 2  # the driver's (its prompts) and the replica's pool
    assert_gone(servers)


@pytest.mark.ray
@pytest.mark.slow
def test_drop_leaves_the_failed_groups_out(tmp_path, ray_session):
    """env.on_error=drop: a group with a failed rollout (every third step raises, the 5th hangs; one
    step per episode) is left out of its batch, the rest trained; at most 3 of a batch's 8 rollouts
    fail, so a batch always keeps a group."""
    from offstep.pipeline.controller import train

    out, record = tmp_path / "run", tmp_path / "record"
    train(
        load_config(
            run_args(
                out,
                "data.train_batch_size=4",
                "rollout.n=2",
                f"+env.args.record={record}",
                "+env.args.tries=1",
                "+env.args.fail_every=3",
                "+env.args.hang_at=5",
                "env.timeout_s=25",
                "env.on_error=drop",
            )
        )
    )
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]
    errors, hangs = failures_of(record)
    assert (
        sum(m["env/errors"] for m in metrics) == errors >= 1 and sum(m["env/timeouts"] for m in metrics) == hangs == 1
    )
    dropped = sum(m["env/dropped_groups"] for m in metrics)
    assert 1 <= dropped <= errors + hangs
    assert_gone(servers_of(record))


@pytest.mark.heavy
def test_the_agent_loop_plays_an_episode(tmp_path):
    """Without Ray or a model: a scripted client answers wrong, then right; the loop sends each reply
    as the action and each observation as the next user turn, and the reward is the steps' sum."""
    import asyncio
    from types import SimpleNamespace

    from offstep.envs.rows import rollouts

    fn = rollouts(load_config(run_args(tmp_path)).env)
    try:
        prompt = fn.prompts()[5][-1]["content"]  # "What is a + b? ..."
        a, b = (int(x) for x in prompt.split("is ")[1].split("?")[0].split(" + "))
        seen = []

        async def create(model, messages):
            seen.append([m["content"] for m in messages])
            text = "0" if len(seen) == 1 else f"It is {a + b}"
            return SimpleNamespace(choices=[SimpleNamespace(message=SimpleNamespace(content=text))])

        client = SimpleNamespace(chat=SimpleNamespace(completions=SimpleNamespace(create=create)))
        out = asyncio.run(fn(client, {"extra_info": {"env_task": 5}, "model": "policy"}))
    finally:
        fn.close()
    assert out == {"score": 1.0}
    assert seen == [[prompt], [prompt, "0", "Wrong. Try again: answer with the number."]]
    assert all(p.poll() is not None for p in fn.pool._procs)  # close stopped every server


def _cmdline(pid: int) -> list[str]:
    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []
