"""OpenAI agents' rows through the whole pipeline (Ray): preset=tiny with every row answered by an
agent function that talks to the replica's endpoint, one-step off-policy, two steps."""

from __future__ import annotations

import pytest

from offstep.config.loader import load_config
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
    train(load_config([
        "preset=tiny", "pipeline.max_staleness=1", "trainer.total_steps=2", f"trainer.output_dir={out}",
        "trainer.progress=off", "data.task_val_size=4", "trainer.val_before_train=false", "rollout.max_new_tokens=40",
        "rollout.agent.default_agent=openai", f"rollout.agent.openai_path={agent}",
        "trainer.log_samples_freq=1", "trainer.log_samples_count=8",
    ]))
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

    monkeypatch.chdir(Path(__file__).resolve().parent.parent)  # the preset names the example agent from the root
    train(load_config([
        "preset=calculator_openai", "trainer.total_steps=1", f"trainer.output_dir={tmp_path}", "trainer.progress=off",
        "trainer.val_before_train=false", "data.train_batch_size=4", "data.task_val_size=4",
    ]))
    m = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert m["agent/tool_calls/mean"] > 0 and m["agent/turns/max"] >= 2, m
    assert 0 < m["agent/masked_token_frac"] < 1 and m["agent/prefix_breaks"] == 0
