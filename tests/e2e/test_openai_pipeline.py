"""OpenAI agents' rows through the whole pipeline (Ray): preset=tiny with every row answered by an
agent function that talks to the replica's endpoint, one-step off-policy, two steps."""

from __future__ import annotations

import pytest
from conftest import FAST_ONE_STEP

from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl

pytestmark = pytest.mark.ray

AGENT = '''
async def rollout(client, row):
    first = await client.chat.completions.create(model=row["model"], messages=row["messages"], max_tokens=3)
    messages = row["messages"] + [first.choices[0].message.model_dump(exclude_none=True),
                                  {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model=row["model"], messages=messages)
    # the row's part of the reward is known to the test; the model's part varies within a group
    return len(row["messages"][-1]["content"]) % 3 + 0.01 * len(second.choices[0].message.content)
'''


def test_openai_agent_rows_train(tmp_path, ray_session):
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    out = tmp_path / "run"
    train(
        load_config(
            [
                "preset=tiny",
                "pipeline.max_staleness=1",
                "trainer.total_steps=2",
                f"trainer.output_dir={out}",
                "trainer.progress=off",
                "data.task_val_size=4",
                "trainer.val_before_train=false",
                "rollout.max_new_tokens=40",
                "rollout.agent.default_agent=openai",
                f"rollout.agent.openai_path={agent}",
                "trainer.log_samples_freq=1",
                "trainer.log_samples_count=8",
            ]
        )
    )
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # both calls of every rollout on one trajectory: the user turn between them masked, nothing broken
        assert m["agent/turns/mean"] >= 1.5 and m["agent/prefix_breaks"] == 0, m
        assert 0 < m["agent/masked_token_frac"] < 1 and m["actor/grad_norm"] > 0
    assert [m["rollout/staleness_max"] for m in metrics] == [0, 1]
    rows = read_jsonl(out / "samples.jsonl")
    assert rows and all(r["turns"] in (1, 2) for r in rows)
    for r in rows:  # the reward is what the agent function returned
        assert 0 <= r["reward"] - len(r["prompt"]) % 3 < 1, r


@pytest.mark.model
@pytest.mark.slow
def test_calculator_openai_preset_calls_the_tool(tmp_path, ray_session, monkeypatch):
    """preset=calculator_openai on SmolLM2-135M, one step of a few prompts: through the endpoint,
    the model calls the calculator (parsed into tool_calls), the tool turns are masked, no history
    breaks."""
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the preset names the example agent from the root
    train(
        load_config(
            [
                "preset=calculator_openai",
                "trainer.total_steps=1",
                f"trainer.output_dir={tmp_path}",
                "trainer.progress=off",
                "trainer.val_before_train=false",
                "data.train_batch_size=4",
                "data.task_val_size=4",
                *FAST_ONE_STEP,
            ]
        )
    )
    m = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert m["agent/tool_calls/mean"] > 0 and m["agent/turns/max"] >= 2, m
    assert 0 < m["agent/masked_token_frac"] < 1 and m["agent/prefix_breaks"] == 0


# An agent that stops mid-rollout, between its two calls, once the file named by $BLOCK_AFTER exists.
BLOCKING_AGENT = '''
import asyncio, os

async def rollout(client, row):
    first = await client.chat.completions.create(model=row["model"], messages=row["messages"], max_tokens=3)
    gate = os.environ.get("BLOCK_AFTER")
    if gate and os.path.exists(gate):
        await asyncio.sleep(3600)
    messages = row["messages"] + [first.choices[0].message.model_dump(exclude_none=True),
                                  {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model=row["model"], messages=messages)
    return (len(second.choices[0].message.content) % 3) / 2.0
'''


@pytest.mark.slow
def test_a_kill_inside_the_agents_resumes_without_losing_or_repeating_a_step(tmp_path, ray_session):
    """SIGKILL while every rollout of a batch waits inside its agent, between two calls; the run
    resumes from the step-3 checkpoint (with k = 1 it holds the batch that was generating then) and
    each step is trained once. Not bit for bit against an uninterrupted run: which requests the
    endpoint batches together depends on the agents' timing (docs/openai-agents.md)."""
    import os
    import signal
    import time

    from cli_runs import cli, wait_for

    agent = tmp_path / "agent.py"
    agent.write_text(BLOCKING_AGENT)
    run = tmp_path / "run"
    args = [
        "preset=tiny",
        f"trainer.output_dir={run}",
        "trainer.total_steps=6",
        "trainer.save_freq=3",
        "pipeline.max_staleness=1",
        "trainer.val_freq=0",
        "trainer.val_before_train=false",
        "trainer.progress=off",
        "rollout.max_new_tokens=40",
        "rollout.agent.default_agent=openai",
        f"rollout.agent.openai_path={agent}",
    ]
    gate = run / "checkpoints" / "step_000003" / "trainer_state.json"
    proc = cli(args, env={**os.environ, "BLOCK_AFTER": str(gate)})
    wait_for(gate, proc)
    time.sleep(1.0)  # into step 4, whose next batch's agents now wait
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = [m["step"] for m in read_jsonl(run / "metrics.jsonl")]
    assert before and max(before) < 6, "the run was meant to be killed before it finished"

    history = train(load_config(args))  # trainer.resume=auto
    assert [m["step"] for m in history] == [4, 5, 6]
    steps = [m["step"] for m in read_jsonl(run / "metrics.jsonl") if m["step"] >= 1]
    assert steps == [1, 2, 3, 4, 5, 6], steps  # none lost, none repeated
    for m in history:
        assert m["agent/turns/mean"] >= 1.5 and m["agent/prefix_breaks"] == 0 and 0 < m["agent/masked_token_frac"] < 1
