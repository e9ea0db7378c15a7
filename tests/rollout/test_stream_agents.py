"""Agents' rows on a streaming replica (``offstep.rollout.stream.stream_agents``, ``pipeline.mode=fully_async``)
on the built-in engine, without Ray: a tool loop and an OpenAI agent (the real ``openai`` SDK
against the replica's endpoint) whose trajectory crosses a weight load posted between two decode
steps. The model is tests/scripted_model.py's: it calls the tool ``x`` after every assistant
header, so the first turns are known and a later turn is in flight when the load lands.

- ``recompute``: a model token sampled before the load carries version 0 and the old weights'
  teacher-forced log-prob, one after it version 1 and the new weights'; a turn crosses the load.
- ``keep``: the same tags; the crossing turn's tokens after the load continue on the old weights'
  cache, so they equal neither policy; the turns after it are the new weights'.
- ``off``: no model turn crosses the load (the turn in flight ends under the old weights, the
  next turns are the new weights'): each turn is one version's.
- Tool tokens: masked, log-prob 0, ``NO_VERSION``.
- With no load and greedy sampling, a stream's sample is batch mode's token for token.
- A tool loop suspended inside its second model turn (a checkpoint) goes on from that turn's start
  when submitted again, to the trajectory an uninterrupted stream samples.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from scripted_model import X_TOOL, scripted_model

from offstep.batch import NO_VERSION
from offstep.config.choices import OPENAI_AGENT, TOOL_AGENT
from offstep.config.schema import AgentConfig
from offstep.rollout.agents.agent_loop import AgentRunner, run_tool_rows
from offstep.rollout.agents.openai_agent import OpenAIRunner
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.replica_spec import Request
from offstep.rollout.stream.replica_stream import GroupWork, StreamServer
from offstep.rollout.stream.stream_agents import attach_agents
from offstep.rollout.types import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.heavy  # tiny-model generation, an HTTP endpoint

USER = [{"role": "user", "content": "What is x of 5?"}]
TOL = 2e-4  # fp32 on CPU: the engine's log-probs against a full forward pass
TOOL = 'def x(expression: str) -> str:\n    """x.\n\n    Args:\n        expression: e\n    """\n    return "25"\n'
AGENT = f'''
X_TOOL = {X_TOOL!r}

async def rollout(client, row):
    messages = list(row["messages"])
    for _ in range(3):
        reply = await client.chat.completions.create(model=row["model"], messages=messages, tools=[X_TOOL])
        choice = reply.choices[0]
        if not choice.message.tool_calls:
            return 1.0
        messages.append(choice.message.model_dump(exclude_none=True))
        for call in choice.message.tool_calls:
            messages.append({{"role": "tool", "tool_call_id": call.id, "content": "25"}})
    return 0.5
'''
FIRST_TURN = 8  # "<x>5 </x>": the scripted model's tokens after an assistant header


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from offstep.models.loading import eos_token_ids, load_tokenizer, resolve_model

    path = resolve_model("tiny")
    tok = load_tokenizer(path)
    eos = eos_token_ids(tok, path)
    model = scripted_model(path, sharpness=30.0)  # the scripted token almost surely
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(1)
    new = {n: p + 0.2 * torch.randn(p.shape, generator=gen) for n, p in old.items()}
    files = tmp_path_factory.mktemp("agents")
    (files / "x_tool.py").write_text(TOOL)
    (files / "agent.py").write_text(AGENT)
    spec = AgentConfig(
        tools=["x"], tools_path=str(files / "x_tool.py"), format="tag", max_turns=3, openai_path=str(files / "agent.py")
    )
    return tok, eos, model, old, new, spec


def _prompt(tok):
    return tok(
        tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False, tools=[X_TOOL]),
        add_special_tokens=False,
    ).input_ids


def _stream(parts, agent_name: str, partial: str, params: SamplingParams, load_after: int | None):
    """One group of ``params.n`` samples of an agent's row through a StreamServer; after
    ``load_after`` sampled tokens in all, a load of the new weights is posted from the engine's
    thread (it lands at the next step boundary). Returns the group's samples."""
    tok, eos, model, old, new, spec = parts
    engine = TorchEngine(model, tok, eos)
    engine.load_weights(old, 0)
    prompt = _prompt(tok)
    pool = ThreadPoolExecutor(2)
    server = StreamServer(
        engine,
        [prompt],
        params,
        partial,
        8,
        lambda r, text, info=None: (0.0, {}),
        pool,
        tok,
        share_prefix=agent_name != OPENAI_AGENT,
    )
    runners = (AgentRunner(spec, tok, eos), OpenAIRunner(spec, tok, eos) if agent_name == OPENAI_AGENT else None)
    attach_agents(server, *runners, engine, params)
    count, posted, append = [0], [], engine._append

    def counting(*args):
        count[0] += 1
        if count[0] == load_after:
            posted.append(server.control.post_load(lambda: engine.load_weights(new, 1)))
        return append(*args)

    engine._append = counting
    try:
        out = run_group(server, GroupWork(_request(prompt, agent_name), seed=3, stream0=0), 120)
        for f in posted:
            f.result(timeout=5)
    finally:
        server.close()
        runners[0].close()
        engine.load_weights(old, 0)
        del engine._append
    (group,) = out
    assert group.uid == 7 and len(group.samples) == params.n
    return group.samples


def _request(prompt: list[int], agent_name: str) -> Request:
    return Request(uid=7, prompt_ids=prompt, data_source="x", ground_truth="25", agent_name=agent_name, messages=USER)


def run_group(server: StreamServer, work: GroupWork, timeout_s: float) -> list:
    """Submit ``work`` and wait for it to come back finished."""
    server.submit([work])
    deadline, out = time.monotonic() + timeout_s, []
    while not out and time.monotonic() < deadline:
        out = server.take(1.0)
    assert out, "the group did not finish"
    return out


def _teacher(model, weights, prompt, response):
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
        for n, p in model.named_parameters():
            p.copy_(saved[n])
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def _turns(mask: list[int]) -> list[range]:
    """The model turns: runs of mask 1."""
    out, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append(range(start, i))
            start = None
    return out


def _check_trajectory(parts, s, partial: str) -> None:
    tok, _, model, old, new, _ = parts
    n = len(s.response_ids)
    assert len(s.loss_mask) == len(s.rollout_logprobs) == len(s.token_versions) == n
    turns = _turns(s.loss_mask)
    assert len(turns) >= 2 and s.agent.turns == len(turns), "a call of x, its tool turn, then more model turns"
    assert len(turns[0]) == FIRST_TURN and turns[0].start == 0, "the first turn: the scripted call"
    for i in range(n):
        if not s.loss_mask[i]:  # a tool turn's token: no version, no log-prob
            assert s.token_versions[i] == NO_VERSION and s.rollout_logprobs[i] == 0.0
    assert "25" in tok.decode([t for t, m in zip(s.response_ids, s.loss_mask) if not m])
    versions = [v for v, m in zip(s.token_versions, s.loss_mask) if m]
    assert versions == sorted(versions) and set(versions) == {0, 1} and s.version == 0
    lp = torch.tensor(s.rollout_logprobs)
    want = {v: _teacher(model, w, s.prompt_ids, s.response_ids) for v, w in ((0, old), (1, new))}
    crossing = [t for t in turns if len({s.token_versions[i] for i in t}) > 1]
    assert len(crossing) == (0 if partial == "off" else 1), [[s.token_versions[i] for i in t] for t in turns]
    # keep: the crossing turn's tokens after the load attend to the old weights' cache (neither policy's)
    kept = [i for t in crossing for i in t if s.token_versions[i] == 1] if partial == "keep" else []
    for i in range(n):
        if s.loss_mask[i] and i not in kept:
            v = s.token_versions[i]
            assert abs(float(lp[i] - want[v][i])) <= TOL, (i, v, float(lp[i]), float(want[v][i]))
    if kept:
        assert max(abs(float(lp[i] - want[1][i])) for i in kept) > TOL


@pytest.mark.parametrize("agent_name", [TOOL_AGENT, OPENAI_AGENT])
@pytest.mark.parametrize("partial", ["recompute", "keep", "off"])
def test_a_trajectory_crossing_a_load(parts, agent_name, partial):
    """The load is posted three tokens into the second model turn (after the tool turn)."""
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=64)
    (s,) = _stream(parts, agent_name, partial, params, FIRST_TURN + 3)
    _check_trajectory(parts, s, partial)
    if agent_name == OPENAI_AGENT:
        assert s.score in (0.5, 1.0) and s.agent.prefix_breaks == 0  # what the agent returned; one trajectory


@pytest.mark.parametrize("agent_name", [TOOL_AGENT, OPENAI_AGENT])
def test_without_a_load_a_greedy_sample_is_batch_modes(parts, agent_name):
    tok, eos, model, old, _, spec = parts
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=64)
    streamed = _stream(parts, agent_name, "keep", params, None)
    engine = TorchEngine(model, tok, eos)
    engine.load_weights(old, 0)
    request = _request(_prompt(tok), agent_name)
    if agent_name == TOOL_AGENT:
        runner = AgentRunner(spec, tok, eos)

        class Progress:
            def advance(self):
                pass

        batch, _ = run_tool_rows(
            runner, engine, [request], params, 3, lambda r, text, info: (0.0, {}), ThreadPoolExecutor(2), Progress()
        )
        runner.close()
    else:
        batch = OpenAIRunner(spec, tok, eos).run(engine, [request], params, 3)
    for s, b in zip(streamed, batch):
        assert s.prompt_ids == b.prompt_ids and s.response_ids == b.response_ids and s.loss_mask == b.loss_mask
        assert s.rollout_logprobs == pytest.approx(b.rollout_logprobs, abs=TOL)
        assert s.agent.turns == b.agent.turns and s.token_versions == [0 if m else NO_VERSION for m in s.loss_mask]


def test_a_suspended_tool_loop_goes_on_from_its_last_turn(parts):
    """Suspended three tokens into its second model turn, the loop is handed back as it stood when
    that turn began (the first turn and the tool turn); submitted again to a new stream, it samples
    that turn again on the same random stream and ends as the uninterrupted loop did (T = 1)."""
    import threading

    tok, eos, model, old, _, spec = parts
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=64)
    whole = _stream(parts, TOOL_AGENT, "keep", params, None)
    engine = TorchEngine(model, tok, eos)
    engine.load_weights(old, 0)
    prompt = _prompt(tok)
    request = _request(prompt, TOOL_AGENT)

    def server_and_runner():
        server = StreamServer(
            engine, [prompt], params, "keep", 8, lambda r, text, info=None: (0.0, {}), ThreadPoolExecutor(2), tok
        )
        runner = AgentRunner(spec, tok, eos)
        attach_agents(server, runner, None, engine, params)
        return server, runner

    count, reached, append = [0], threading.Event(), engine._append

    def counting(*args):
        count[0] += 1
        if count[0] == 2 * (FIRST_TURN + 3):  # both samples three tokens into their second turn
            reached.set()
        return append(*args)

    engine._append = counting
    server, runner = server_and_runner()
    try:
        server.submit([GroupWork(request, seed=3, stream0=0)])
        assert reached.wait(120), "the loops did not reach their second turn"
        (work,) = server.suspend()
    finally:
        server.close()
        runner.close()
        del engine._append
    for s in work.samples:
        assert not s.finish_reason and s.loop is not None and s.loop["turns"] == 1
        assert s.loop["loss_mask"][:FIRST_TURN] == [1] * FIRST_TURN and s.loop["loss_mask"][-1] == 0  # call, tool turn
    server, runner = server_and_runner()
    try:
        out = run_group(server, work, 120)
    finally:
        server.close()
        runner.close()
    (group,) = out
    for s, w in zip(group.samples, whole):
        assert s.response_ids == w.response_ids and s.loss_mask == w.loss_mask and s.agent.turns == w.agent.turns
        assert s.rollout_logprobs == pytest.approx(w.rollout_logprobs, abs=TOL)
