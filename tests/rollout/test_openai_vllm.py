"""The OpenAI endpoint on the vLLM engine: the same agent as tests/rollout/test_openai_endpoint.py (a
scripted tiny model that calls the tool ``x``), its tool call parsed, and the trained tokens
exactly those vLLM sampled."""

from __future__ import annotations

import os

import pytest
from conftest import needs_vllm
from scripted_model import scripted_model
from test_openai_endpoint import Spy, _client, _tool_agent

from offstep.rollout.agents.openai_server import OpenAIServer

pytestmark = [needs_vllm, pytest.mark.own_process]
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def test_vllm_behind_the_endpoint(tmp_path):
    from offstep.models.loading import eos_token_ids, load_tokenizer, resolve_model
    from offstep.rollout.engines.vllm_engine import VLLMEngine

    tiny = resolve_model("tiny")
    tok = load_tokenizer(tiny)
    scripted_model(tiny).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    eos = eos_token_ids(tok, tiny)
    engine = VLLMEngine(str(tmp_path), tok, eos, max_batch_size=8, num_threads=1)
    spy = Spy(engine)
    srv = OpenAIServer(spy, tok, eos, "tag", budget=40).start(engine_thread=False)
    try:
        key = srv.open_session()  # vLLM's CPU kernels run on the thread that built the engine: this one
        first, second = srv.drive(lambda: _tool_agent(_client(srv, key)))
        assert first.choices[0].message.tool_calls[0].function.name == "x"
        session = srv.close_session(key)
        t = session.trajectory()
        (p1, c1), (p2, c2) = spy.sampled
        between = p2[len(p1) + len(c1.response_ids) :]
        assert session.breaks == 0 and t.prompt_ids == p1
        assert t.response_ids == c1.response_ids + between + c2.response_ids
        assert t.logprobs == c1.logprobs + [0.0] * len(between) + c2.logprobs
    finally:
        srv.close()
        engine.close()
