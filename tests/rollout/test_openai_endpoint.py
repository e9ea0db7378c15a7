"""The OpenAI endpoint of a rollout replica (offstep.rollout.agents.openai_server, openai_record,
openai_agent): the real ``openai`` SDK against the real server on the built-in engine, with a tiny
model built in code whose continuations are scripted (tests/scripted_model.py: it calls the tool
``x``). Tool calls, n > 1, text completions, error objects and status codes, the token, loopback
only, sessions kept apart, the trained tokens exactly the sampled ones, the same trajectory as
offstep's own agent loop, a rewritten history counted, the agent function's loading. No Ray."""

from __future__ import annotations

import asyncio
import json
import os
import socket

import httpx
import openai
import pytest
from scripted_model import CALL_TEXT, X_TOOL, scripted_model

from offstep.config.schema import AgentConfig
from offstep.errors import ToolConfigError
from offstep.rollout.agents.agent_loop import AgentRunner
from offstep.rollout.agents.openai_agent import AgentError, OpenAIRunner, load_agent
from offstep.rollout.agents.openai_server import OpenAIServer
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.replica_spec import Request
from offstep.rollout.types import SamplingParams

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.heavy  # tiny-model generation behind an HTTP server

USER = [{"role": "user", "content": "What is x of 5?"}]


class Spy:
    """The real engine, with a record of every completion its ``generate`` returned."""

    def __init__(self, engine):
        self.engine, self.sampled = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, params, seed, on_finish=None):
        out = self.engine.generate(prompts, params, seed, on_finish)
        self.sampled += [(prompts[c.prompt_index], c) for c in out]
        return out


@pytest.fixture(scope="module")
def parts():
    from offstep.models.loading import eos_token_ids, load_tokenizer, resolve_model

    path = resolve_model("tiny")
    tok = load_tokenizer(path)
    eos = eos_token_ids(tok, path)
    return tok, eos, TorchEngine(scripted_model(path), tok, eos)


@pytest.fixture
def server(parts):
    tok, eos, engine = parts
    spy = Spy(engine)
    srv = OpenAIServer(spy, tok, eos, "tag", budget=40).start()
    yield srv, spy
    srv.close()


def _client(srv, session=None, key=None):
    return openai.AsyncOpenAI(base_url=srv.base_url(session), api_key=key or srv.token, max_retries=0)


async def _tool_agent(client, rewrite=False):
    """Two calls: the first answers with a call of x, whose result goes back as a tool message."""
    messages = list(USER)
    first = await client.chat.completions.create(
        model="policy", messages=messages, tools=[X_TOOL], temperature=0, logprobs=True
    )
    msg = first.choices[0].message
    turn = msg.model_dump(exclude_none=True)
    if rewrite:  # the agent edits what the model said: no longer the sampled turn
        turn["content"] = turn["content"].replace("5", "6")
    messages += [turn, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "25"}]
    second = await client.chat.completions.create(model="policy", messages=messages, tools=[X_TOOL], temperature=0)
    await client.close()
    return first, second


def test_chat_tool_calls_and_the_trained_tokens_are_the_sampled_ones(server):
    srv, spy = server
    key = srv.open_session()
    first, second = asyncio.run(_tool_agent(_client(srv, key)))
    (call,) = first.choices[0].message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == (
        "function",
        "x",
        {"expression": "5"},
    )
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content == CALL_TEXT
    session = srv.close_session(key)
    t = session.trajectory()
    assert session.breaks == 0 and t.turns == 2 and t.tool_calls == 2
    # What is trained is what the engine sampled, id for id and log-prob for log-prob, in order.
    (p1, c1), (p2, c2) = spy.sampled
    assert t.prompt_ids == p1 and p2 == p1 + t.response_ids[: len(p2) - len(p1)]
    between = p2[len(p1) + len(c1.response_ids) :]
    assert t.response_ids == c1.response_ids + between + c2.response_ids
    assert t.loss_mask == [1] * len(c1.response_ids) + [0] * len(between) + [1] * len(c2.response_ids)
    assert t.logprobs == c1.logprobs + [0.0] * len(between) + c2.logprobs
    # The tokens between the calls are the template's tool turn, not the model's decoded text again.
    assert srv.tok.decode(between).startswith("<|im_end|>\n<|im_start|>tool\n25")
    # The log-probs the client got are the recorded ones.
    assert [x.logprob for x in first.choices[0].logprobs.content] == c1.logprobs
    assert first.usage.completion_tokens == len(c1.response_ids) and first.usage.prompt_tokens == len(p1)


def test_same_trajectory_as_offsteps_own_agent_loop(server, tmp_path):
    """The same tool, the same greedy model: the endpoint's sample is the agent loop's, token for
    token, mask for mask, log-prob for log-prob."""
    srv, _ = server
    tok, eos = srv.tok, list(srv.eos)
    tool_file = tmp_path / "x_tool.py"
    tool_file.write_text(
        'def x(expression: str) -> str:\n    """x.\n\n    Args:\n        expression: e\n    """\n    return "25"\n'
    )
    runner = AgentRunner(AgentConfig(tools=["x"], tools_path=str(tool_file), format="tag", max_turns=2), tok, eos)
    prompt = tok(
        tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False, tools=[X_TOOL]),
        add_special_tokens=False,
    ).input_ids
    (loop,) = runner.run(srv.engine.engine, [prompt], [{}], SamplingParams(temperature=0.0, max_new_tokens=40), seed=0)
    runner.close()
    key = srv.open_session()
    asyncio.run(_tool_agent(_client(srv, key)))
    t = srv.close_session(key).trajectory()
    assert t.prompt_ids == prompt
    assert t.response_ids == loop.response_ids and t.loss_mask == loop.loss_mask
    assert t.logprobs == pytest.approx(loop.logprobs, abs=1e-5)


def test_a_rewritten_history_is_a_counted_prefix_break(server):
    srv, _ = server
    key = srv.open_session()
    asyncio.run(_tool_agent(_client(srv, key), rewrite=True))
    session = srv.close_session(key)
    t = session.trajectory()
    # The second call continues nothing that was sampled: it is its own trajectory, the one trained.
    assert session.breaks == 1 and t.turns == 1 and t.prompt_ids == session.calls[1].prompt_ids
    assert t.loss_mask == [1] * len(t.response_ids)


def test_n_choices_sessions_apart_and_text_completions(server):
    srv, spy = server
    a, b = srv.open_session(), srv.open_session()

    async def both():
        ca, cb = _client(srv, a), _client(srv, b)
        chat, text = await asyncio.gather(
            ca.chat.completions.create(model="policy", messages=USER, n=3, max_tokens=5, stop=["</x>"]),
            cb.completions.create(model="policy", prompt="What is", max_tokens=4, logprobs=0, temperature=0.5),
        )
        ids = await cb.completions.create(model="policy", prompt=[1, 67, 201], max_tokens=3)
        await ca.close()
        await cb.close()
        return chat, text, ids

    chat, text, ids = asyncio.run(both())
    assert len(chat.choices) == 3 and [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.message.tool_calls is None for c in chat.choices)  # no tools offered: nothing parsed
    sa, sb = srv.close_session(a), srv.close_session(b)
    assert [len(c.choices) for c in sa.calls] == [3] and [len(c.choices) for c in sb.calls] == [1, 1]
    assert sb.calls[1].prompt_ids == [1, 67, 201] and sb.breaks == 1  # a second root: counted
    choice = text.choices[0]
    assert choice.logprobs.token_logprobs == sb.calls[0].choices[0].logprobs
    assert choice.model_extra["token_ids"] == sb.calls[0].choices[0].ids
    assert text.object == "text_completion" and 1 <= len(choice.logprobs.tokens) <= 4


def test_models_route(server):
    srv, _ = server
    models = openai.OpenAI(base_url=srv.base_url(), api_key=srv.token, max_retries=0).models.list()
    assert [m.id for m in models.data] == ["policy"]


def _error(resp, status, param=None, code=None):
    body = resp.json()
    assert resp.status_code == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"]
    assert body["error"]["param"] == param and (code is None or body["error"]["code"] == code), body
    return body["error"]


def test_errors_are_openai_error_objects(server):
    srv, _ = server
    base, auth = srv.base_url(), {"Authorization": f"Bearer {srv.token}"}
    chat = base + "/chat/completions"
    with httpx.Client(timeout=30) as http:
        ok = {"model": "policy", "messages": USER, "max_tokens": 2}
        _error(http.post(chat, json={"model": "policy"}, headers=auth), 400, "messages", "missing_required_parameter")
        _error(http.post(chat, json={**ok, "temperature": 5}, headers=auth), 400, "temperature", "invalid_value")
        _error(
            http.post(base + "/completions", json={"model": "policy", "prompt": "a", "stream": True}, headers=auth),
            400,
            "stream",
        )
        _error(http.post(chat, json={**ok, "tool_choice": "required"}, headers=auth), 400, "tool_choice")
        _error(
            http.post(chat, json={**ok, "messages": [{"role": "robot", "content": "x"}]}, headers=auth),
            400,
            "messages.0.role",
        )
        _error(http.post(chat, json={**ok, "tools": [{"type": "function"}]}, headers=auth), 400, "tools")
        _error(
            http.post(chat, content=b"{not json", headers={**auth, "Content-Type": "application/json"}),
            400,
            code="invalid_json",
        )
        _error(http.post(chat, json={**ok, "model": "gpt-4o"}, headers=auth), 404, "model", "model_not_found")
        _error(
            http.post(srv.base_url("nosuchsession") + "/chat/completions", json=ok, headers=auth),
            404,
            code="session_not_found",
        )
        _error(http.get(base + "/embeddings", headers=auth), 404, code="not_found")
        _error(http.get(chat, headers=auth), 405, code="method_not_allowed")
        _error(
            http.post(base + "/completions", json={"model": "policy", "prompt": [10**6]}, headers=auth), 400, "prompt"
        )
        # The token: missing or wrong, refused before anything else is looked at.
        _error(http.post(chat, json=ok), 401, code="invalid_api_key")
        _error(http.get(base + "/models", headers={"Authorization": "Bearer wrong"}), 401, code="invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.base_url(), api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as err:
        asyncio.run(_client(srv).chat.completions.create(model="gpt-4o", messages=USER))
    assert err.value.code == "model_not_found"


def _listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        return s.connect_ex((host, port)) == 0


def _outside_address() -> str | None:
    """An address of this machine other than loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            addr = s.getsockname()[0]
        except OSError:
            return None
    return None if addr.startswith("127.") else addr


def test_loopback_only_and_gone_when_closed(parts):
    tok, eos, engine = parts
    srv = OpenAIServer(engine, tok, eos, "tag", budget=8).start()
    port = srv.port
    assert srv._sock.getsockname() == ("127.0.0.1", port) and _listening("127.0.0.1", port)
    outside = _outside_address()
    if outside is not None:
        assert not _listening(outside, port)
    srv.close()
    assert not _listening("127.0.0.1", port)


def test_budget_spent_cuts_the_trajectory(server):
    srv, _ = server
    key = srv.open_session(budget=8)

    async def agent(client):
        first = await client.chat.completions.create(model="policy", messages=USER, tools=[X_TOOL], temperature=0)
        msg = first.choices[0].message
        follow = USER + [
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "25"},
        ]
        return await client.chat.completions.create(model="policy", messages=follow, tools=[X_TOOL])

    second = asyncio.run(agent(_client(srv, key)))
    assert second.choices[0].finish_reason == "length" and second.choices[0].message.content == ""
    t = srv.close_session(key).trajectory()
    assert t.finish_reason == "length" and len(t.response_ids) <= 8 and t.turns == 1


# ------------------------------------------------------------------ the agent function

AGENT = '''
async def rollout(client, row):
    first = await client.chat.completions.create(model=row["model"], messages=row["messages"], max_tokens=4)
    messages = row["messages"] + [first.choices[0].message.model_dump(exclude_none=True),
                                  {"role": "user", "content": "Sure?"}]
    second = await client.chat.completions.create(model=row["model"], messages=messages, max_tokens=4)
    if row["extra_info"].get("fail"):
        raise RuntimeError("boom")
    return {"score": float(len(second.choices[0].message.content)), "calls": 2, "note": "not a number"}

def not_async(client, row):
    return 1.0

async def returns_text(client, row):
    await client.chat.completions.create(model=row["model"], messages=row["messages"], max_tokens=2)
    return "good"

async def no_call(client, row):
    return 1.0
'''


def test_runner_scores_each_rollout_with_what_the_agent_returned(parts, tmp_path):
    tok, eos, engine = parts
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    runner = OpenAIRunner(AgentConfig(openai_path=str(path)), tok, eos)
    requests = [
        Request(
            uid=7, prompt_ids=[1], data_source="t", ground_truth="1", extra_info={}, agent_name="openai", messages=USER
        )
    ]
    listening = _listening_ports()
    samples = runner.run(engine, requests, SamplingParams(n=2, max_new_tokens=30), seed=0)
    assert _listening_ports() == listening  # the endpoint served this call only: its socket is gone
    assert len(samples) == 2 and {s.uid for s in samples} == {7}
    for s in samples:
        assert s.agent.turns == 2 and s.agent.prefix_breaks == 0 and s.reward_extra == {"calls": 2.0}
        assert 0 in s.loss_mask and len(s.response_ids) <= 30 and s.version == engine.version
        assert s.score == float(
            len(tok.decode(s.response_ids[len(s.loss_mask) - s.loss_mask[::-1].index(0) :], skip_special_tokens=True))
        )
    requests[0].extra_info["fail"] = True
    with pytest.raises(AgentError, match="raised on row.*boom"):
        runner.run(engine, requests, SamplingParams(n=1, max_new_tokens=12), seed=0)
    for name, match in (("returns_text", "non-number str"), ("no_call", "sampled no token")):
        bad = OpenAIRunner(AgentConfig(openai_path=str(path), openai_name=name), tok, eos)
        with pytest.raises(AgentError, match=match):
            bad.run(engine, requests, SamplingParams(n=1, max_new_tokens=4), seed=0)


def _listening_ports() -> set[int]:
    import psutil

    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}


def test_the_example_agent_runs_against_the_endpoint(parts):
    """examples/agents/calculator_agent.py through the runner: the scripted model answers with a
    call of x, not of the calculator, which the agent reads as a plain (wrong) answer."""
    from pathlib import Path

    tok, eos, engine = parts
    example = Path(__file__).resolve().parents[2] / "examples" / "agents" / "calculator_agent.py"
    runner = OpenAIRunner(AgentConfig(openai_path=str(example)), tok, eos)
    rows = [
        Request(
            uid=0,
            prompt_ids=[1],
            data_source="calculator",
            ground_truth="437",
            agent_name="openai",
            messages=[{"role": "user", "content": "What is 23 * 19?"}],
        )
    ]
    (sample,) = runner.run(engine, rows, SamplingParams(n=1, max_new_tokens=20), seed=0)
    assert sample.score == 0.0 and sample.reward_extra == {"acc": 0.0} and sample.agent.turns == 1
    assert sample.agent.tool_calls == 0  # "<x>5 </x>" is no call of the tools the agent offers


def test_load_agent_names_the_key_and_the_fix(tmp_path):
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    assert load_agent(str(path)).__name__ == "rollout"
    cases = [
        (None, "rollout", "rollout.agent.openai_path is not set"),
        (str(tmp_path / "missing.py"), "rollout", "agent file .*missing.py not found.*rollout.agent.openai_path"),
        (
            str(path),
            "nope",
            r"no function 'nope' \(rollout.agent.openai_name\).*\['no_call', 'returns_text', 'rollout'\]",
        ),
        (str(path), "not_async", "is not async.*async def not_async"),
    ]
    for p, name, match in cases:
        with pytest.raises(ToolConfigError, match=match):
            load_agent(p, name)
    broken = tmp_path / "broken.py"
    broken.write_text("import nosuchmodule_xyz\n")
    with pytest.raises(ToolConfigError, match="agent file .* failed to import"):
        load_agent(str(broken))


def test_config_needs_the_agent_file_before_start():
    from offstep.launch.loader import load_config
    from offstep.launch.validate import problems

    (msg,) = problems(load_config(["preset=tiny", "rollout.agent.default_agent=openai"]))
    assert "needs rollout.agent.openai_path" in msg
    for engine in ("builtin", "vllm"):  # both engines serve OpenAI agents in the stream (test_stream_agents*.py)
        assert not problems(
            load_config(
                [
                    "preset=tiny",
                    "rollout.agent.default_agent=openai",
                    "rollout.agent.openai_path=a.py",
                    "pipeline.mode=fully_async",
                    f"rollout.engine={engine}",
                ]
            )
        )


def test_the_calculator_openai_preset(tmp_path, monkeypatch):
    """preset=calculator_openai: the calculator task's rows answered by the example agent, whose
    file resolves from the repository's root; nothing refused before start."""
    from pathlib import Path

    from offstep.data.tasks import write_task
    from offstep.launch.loader import load_config
    from offstep.launch.validate import problems

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    cfg = load_config(["preset=calculator_openai"])
    assert problems(cfg) == [] and cfg.rollout.agent.openai_path == "examples/agents/calculator_agent.py"
    assert load_agent(cfg.rollout.agent.openai_path).__name__ == "rollout"
    import pyarrow.parquet as pq

    train, _ = write_task("calculator", str(tmp_path), 4, 2, 0, **cfg.data.task_options)
    assert set(pq.read_table(train).column("agent_name").to_pylist()) == {"openai"}


def test_a_dataset_only_agents_score_is_not_refused(tmp_path):
    """Rows answered by an OpenAI agent need no scorer: a data source without one and a ground
    truth no rule scorer reads are fine, for the checks before start and the inputs' preparation."""
    from offstep.launch.loader import load_config
    from offstep.launch.preflight import environment_problems
    from offstep.pipeline.inputs import prepare_inputs

    data = tmp_path / "tasks.jsonl"
    row = {
        "prompt": [{"role": "user", "content": "Book a table."}],
        "data_source": "my_env",
        "reward_model": {"ground_truth": {"booked": True}},
    }
    data.write_text("\n".join(json.dumps(row) for _ in range(4)) + "\n")
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    cfg = load_config(
        [
            "preset=tiny",
            f"data.train_files=[{data}]",
            f"data.val_files=[{data}]",
            "data.train_batch_size=2",
            "rollout.agent.default_agent=openai",
            f"rollout.agent.openai_path={agent}",
        ]
    )
    assert not [p for p in environment_problems(cfg) if "my_env" in p or "scorer" in p]
    inputs = prepare_inputs(cfg, tmp_path / "run")
    assert inputs.agent is cfg.rollout.agent and {p.record.agent_name for p in inputs.train} == {"openai"}
    # without the agent, the same rows are refused: nothing would score them
    with pytest.raises(Exception, match="my_env"):
        prepare_inputs(
            load_config(["preset=tiny", f"data.train_files=[{data}]", "data.train_batch_size=2"]), tmp_path / "r2"
        )


def test_messages_the_template_refuses_are_a_422(parts):
    import copy

    tok, eos, engine = parts
    strict = copy.deepcopy(tok)
    strict.chat_template = (
        "{% if messages[0]['role'] == 'developer' %}{{ raise_exception('no developer role') }}"
        "{% endif %}" + tok.chat_template
    )
    srv = OpenAIServer(engine, strict, eos, "tag", budget=8).start()
    try:
        with httpx.Client(timeout=30) as http:
            resp = http.post(
                srv.base_url() + "/chat/completions",
                headers={"Authorization": f"Bearer {srv.token}"},
                json={"model": "policy", "messages": [{"role": "developer", "content": "hi"}]},
            )
        err = _error(resp, 422, "messages", "template_error")
        assert "no developer role" in err["message"]
    finally:
        srv.close()


def test_chat_streams_the_answer_and_records_it(server):
    """stream=True (as agent frameworks often ask): the SDK's stream gives the same message and
    tool call, and the session records the call as any other."""
    srv, spy = server
    key = srv.open_session()

    async def agent(client):
        content, calls, finish, usage = "", {}, None, None
        stream = await client.chat.completions.create(
            model="policy",
            messages=USER,
            tools=[X_TOOL],
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                content += c.delta.content or ""
                for t in c.delta.tool_calls or []:
                    calls.setdefault(t.index, t)
                finish = c.finish_reason or finish
        await client.close()
        return content, calls, finish, usage

    content, calls, finish, usage = asyncio.run(agent(_client(srv, key)))
    assert content == CALL_TEXT and finish == "tool_calls" and calls[0].function.name == "x"
    ((prompt, sampled),) = spy.sampled
    assert usage.completion_tokens == len(sampled.response_ids)
    t = srv.close_session(key).trajectory()
    assert t.prompt_ids == prompt and t.response_ids == sampled.response_ids and t.logprobs == sampled.logprobs
