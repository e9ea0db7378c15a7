"""Agents' rows in ``pipeline.mode=fully_async`` through Ray (offstep.rollout.stream.stream_agents), on a
tiny model built in code whose continuations are scripted (tests/scripted_model.py: after every
assistant header it calls the tool ``x``), saved where ``model.path`` points: a tool loop and an
OpenAI agent, each a few steps. The samples a checkpoint stores have every model token tagged
with its version and every tool token masked and of no version; the OpenAI agent waits between its
calls, so a weight load lands while later groups' trajectories are between turns and the samples
trained cross it. The metrics of the
mode (partial samples, versions per sample) and the ``agent/`` ones are logged every step."""

from __future__ import annotations

import json

import pytest
from conftest import ENGINES_SLOW_VLLM
from scripted_model import X_TOOL, scripted_model
from test_fully_async import STREAM_METRICS

from offstep.batch import NO_VERSION
from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl
from offstep.telemetry.names import Stage, replica_index

pytestmark = pytest.mark.ray

X = 'def x(expression: str) -> str:\n    """x.\n\n    Args:\n        expression: e\n    """\n    return "25"\n'
AGENT = f'''
import asyncio
import itertools

X_TOOL = {X_TOOL!r}
STARTED = itertools.count()


async def rollout(client, row):
    # The rollouts of groups 4-7 (n = 2, started in admission order on the one replica) wait between
    # their calls for longer than step 1 takes: the load of version 1 lands inside their trajectories.
    wait = 6.0 if 8 <= next(STARTED) < 16 else 0.0
    messages = list(row["messages"])
    for _ in range(2):
        reply = await client.chat.completions.create(model=row["model"], messages=messages, tools=[X_TOOL])
        choice = reply.choices[0]
        if not choice.message.tool_calls:
            return 1.0
        messages.append(choice.message.model_dump(exclude_none=True))
        await asyncio.sleep(wait)
        for call in choice.message.tool_calls:
            messages.append({{"role": "tool", "tool_call_id": call.id, "content": "25"}})
    return 0.5
'''
AGENT_METRICS = [
    "agent/turns/mean",
    "agent/tool_calls/mean",
    "agent/masked_token_frac",
    "agent/well_formed_calls/frac",
    "agent/prefix_breaks",
]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from offstep.models.loading import load_tokenizer, resolve_model

    root = tmp_path_factory.mktemp("scripted")
    tiny = resolve_model("tiny")
    scripted_model(tiny, sharpness=1.5).save_pretrained(root / "model")  # the call almost surely, some entropy left
    load_tokenizer(tiny).save_pretrained(root / "model")
    (root / "x_tool.py").write_text(X)
    (root / "agent.py").write_text(AGENT)
    return root


def _run(out, files, k: int, save_freq: int, agent: list[str]):
    train(
        load_config(
            [
                "preset=tiny",
                f"model.path={files / 'model'}",
                "pipeline.mode=fully_async",
                f"pipeline.max_staleness={k}",
                "trainer.total_steps=3",
                f"trainer.save_freq={save_freq}",
                f"trainer.output_dir={out}",
                "trainer.progress=off",
                "trainer.val_before_train=false",
                "data.task_val_size=4",
                "rollout.max_new_tokens=64",
                *agent,
            ]
        )
    )
    everything = read_jsonl(out / "metrics.jsonl")
    metrics = [m for m in everything if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        missing = [k for k in STREAM_METRICS + AGENT_METRICS if k not in m]
        assert not missing, missing
        assert 0 <= m["rollout/staleness_max"] <= k and m["actor/grad_norm"] > 0
        assert m["agent/tool_calls/mean"] > 0 and 0 < m["agent/masked_token_frac"] < 1, m
    assert "val/agent/turns/mean" in everything[-1]  # validation's agents, between two decode steps of the stream
    return metrics


def _check_stored_samples(out) -> None:
    """The samples a checkpoint stored (finished, not yet trained): model tokens 1 in the mask with
    their version, tool tokens 0 with log-prob 0 and no version, and a tool turn in some."""
    stored = json.loads((out / "checkpoints" / "step_000002" / "trainer_state.json").read_text())["stream_groups"]
    samples = [s for g in stored["groups"] for s in g["samples"] or []]
    states = [s for g in stored["groups"] for s in g["states"] or [] if s["finish_reason"]]
    assert samples or states, stored
    looped = 0
    for s in samples + states:
        mask = s["loss_mask"]
        tokens = s.get("response_ids", s.get("tokens"))
        logprobs = s.get("rollout_logprobs", s.get("logprobs"))
        versions = s.get("token_versions", s.get("versions"))
        assert len(mask) == len(tokens) == len(logprobs) == len(versions)
        assert mask[0] == 1 and s["agent"]["turns"] >= 1
        for m, lp, v in zip(mask, logprobs, versions):
            assert (v >= 0) if m else (v == NO_VERSION and lp == 0.0)
        looped += 0 in mask
    assert looped, "some stored sample has a tool turn"


@pytest.mark.parametrize("engine", ENGINES_SLOW_VLLM)
def test_tool_loops_stream(tmp_path, ray_session, files, engine):
    """Two-step staleness: every group is admitted at the start, and those of step 3 have
    finished when step 2's checkpoint stores them, with their masks."""
    out = tmp_path / "run"
    _run(
        out,
        files,
        2,
        2,
        [
            "rollout.agent.default_agent=tool_agent",
            "rollout.agent.tools=[x]",
            f"rollout.agent.tools_path={files / 'x_tool.py'}",
            "rollout.agent.format=tag",
            "rollout.agent.max_turns=2",
            "rollout.partial=recompute",
            f"rollout.engine={engine}",
        ],
    )
    _check_stored_samples(out)
    tools = [e for e in read_jsonl(out / "timeline.jsonl") if e["stage"] == Stage.TOOL]
    assert tools and all(replica_index(e["role"]) is not None for e in tools), "tool time on the replicas' lanes"


def test_openai_agents_stream(tmp_path, ray_session, files):
    out = tmp_path / "run"
    # no checkpoint before the last step: a suspension starts unfinished agents again (stream_agents)
    metrics = _run(
        out,
        files,
        1,
        0,
        [
            "rollout.agent.default_agent=openai",
            f"rollout.agent.openai_path={files / 'agent.py'}",
            "rollout.agent.format=tag",
        ],
    )
    assert all(m["agent/prefix_breaks"] == 0 and m["agent/turns/mean"] >= 1.5 for m in metrics), metrics
    # step 2 trains groups 4-7: admitted at version 0, their later calls sampled by version 1
    assert metrics[1]["rollout/partial_samples"] > 0 and metrics[1]["rollout/version_span_max"] == 2, metrics
