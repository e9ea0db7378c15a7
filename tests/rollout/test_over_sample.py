"""verl's over-sampling (``rollout.over_sample_rate``; ``offstep.rollout.engines.plain_generation``):
a generation call stops once ``int(total * (1 - rate))`` of its samples finished; the slowest, in
flight or never started, are cut. The finished ones are exactly those of a full generation (the
cut changes nothing before it), and a cut one is a prefix of its full sample. Tool loops follow
the same rule."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import needs_vllm
from test_agent_loop import ScriptedEngine, _prompt, eos, tok  # noqa: F401 (fixtures)
from test_engine import prompts, tiny  # noqa: F401 (fixtures)
from test_tools import tool_file  # noqa: F401 (a fixture)

from offstep.config.schema import AgentConfig
from offstep.rollout.agents.agent_loop import AgentRunner, run_tool_rows
from offstep.rollout.engines.control import SUSPENDED
from offstep.rollout.engines.plain_generation import CUT, CUT_REASONS, finish_target
from offstep.rollout.engines.torch_engine import TorchEngine
from offstep.rollout.replica_spec import Request
from offstep.rollout.types import SamplingParams
from offstep.telemetry.progress import ProgressClient


def test_the_finish_target_is_verls():
    """verl: ``int(total_requests * (1 - over_sample_rate))``; at least one sample finishes."""
    assert finish_target(16, 0.0) == 16
    assert finish_target(16, 0.1) == 14  # int(14.4)
    assert finish_target(10, 0.25) == 7  # int(7.5)
    assert finish_target(4, 0.9) == 1  # int(0.4) = 0: one at least


@pytest.mark.heavy
@pytest.mark.parametrize("runner,slots", [("slots", 32), ("slots", 4), ("hf", 32)])
def test_the_slowest_samples_are_cut_and_the_others_are_unchanged(tiny, prompts, runner, slots):
    _, tok, model, _ = tiny
    stops = list(range(3, len(tok), 9))  # a ninth of the vocabulary ends a sample: lengths spread out
    engine = TorchEngine(model, tok, stops, max_batch_size=slots, runner=runner)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=40)
    full = engine.generate(prompts, params, seed=3)
    seen = []
    cut = engine.generate(prompts, dataclasses.replace(params, over_sample_rate=0.5), seed=3, on_finish=seen.append)
    target = finish_target(len(full), 0.5)
    done = [c for c in cut if c.finish_reason not in CUT_REASONS]
    # The target, and those that finished at the same decode step as the last of it.
    assert target <= len(done) < len(full) and len(seen) == len(done)
    assert {id(c) for c in seen} == {id(c) for c in done}  # on_finish saw the finished ones only
    for a, b in zip(cut, full):
        if a.finish_reason in CUT_REASONS:
            assert a.response_ids == b.response_ids[: len(a.response_ids)] and len(a.response_ids) < len(b.response_ids)
            assert a.finish_reason == SUSPENDED or (a.finish_reason == CUT and not a.response_ids)
        else:
            assert (a.response_ids, a.logprobs, a.finish_reason) == (b.response_ids, b.logprobs, b.finish_reason)
    if slots >= len(full):  # all started together: the finished are the shortest of the full generation
        assert max(len(c.response_ids) for c in done) <= min(
            len(b.response_ids) for a, b in zip(cut, full) if a.finish_reason in CUT_REASONS
        )


@pytest.mark.heavy
def test_without_the_rate_nothing_is_cut(tiny, prompts):
    _, tok, model, eos = tiny
    out = TorchEngine(model, tok, eos, max_batch_size=4).generate(prompts, SamplingParams(n=2, max_new_tokens=8), 0)
    assert all(c.finish_reason in ("stop", "length") for c in out)


def test_tool_loops_past_the_target_are_cut(tok, eos, tool_file):
    """Four loops of one row, each a tool call then an answer; with rate 0.5 two loops end and the
    other two are cut (their turn taken after the target is ended, no turn after it): two samples."""
    engine = ScriptedEngine(
        tok,
        eos,
        lambda req: "<lookup>k</lookup>" if "tool" not in tok.decode(req.prompt_ids[-30:]) else "done<|im_end|>",
    )
    row = Request(
        uid=1,
        prompt_ids=_prompt(tok),
        data_source="d",
        ground_truth="g",
        agent_name="tool_agent",
        extra_info={"index": 0, "tools_kwargs": {"lookup": {"create_kwargs": {"table": {"k": "v"}}}}},
    )
    runner = AgentRunner(AgentConfig(tools=["lookup"], tools_path=tool_file, max_turns=2), tok, eos)
    try:
        got = {}
        for rate in (0.0, 0.5):
            samples, _ = run_tool_rows(
                runner,
                engine,
                [row],
                SamplingParams(n=4, max_new_tokens=64, over_sample_rate=rate),
                0,
                lambda r, text, info: (1.0, {}),
                ThreadPoolExecutor(1),
                ProgressClient(),
            )
            got[rate] = samples
    finally:
        runner.close()
    assert len(got[0.0]) == 4 and len(got[0.5]) == 2
    assert all(s.agent.turns == 2 and s.finish_reason == "stop" for s in got[0.5])


@needs_vllm
@pytest.mark.own_process
def test_vllm_cuts_the_slowest_samples_too(tiny, prompts):  # noqa: F811 (fixtures)
    """The same rule on vLLM, through the step control its partial rollouts use: the finished
    samples are those of a full generation (every sample admitted at once in both), a cut one is a
    prefix of its full sample."""
    from offstep.rollout.engines.vllm_engine import VLLMEngine

    path, tok, _, _ = tiny
    engine = VLLMEngine(path, tok, list(range(3, len(tok), 9)), dtype="float32", num_threads=2)
    try:
        params = SamplingParams(n=4, temperature=1.0, max_new_tokens=40)
        full = engine.generate(prompts, params, seed=3)
        seen = []
        cut = engine.generate(prompts, dataclasses.replace(params, over_sample_rate=0.5), 3, on_finish=seen.append)
    finally:
        engine.close()
    done = [c for c in cut if c.finish_reason not in CUT_REASONS]
    assert finish_target(len(full), 0.5) <= len(done) < len(full) and len(seen) == len(done)
    for a, b in zip(cut, full):
        if a.finish_reason in CUT_REASONS:
            assert a.response_ids == b.response_ids[: len(a.response_ids)] and len(a.response_ids) < len(b.response_ids)
        else:
            assert (a.response_ids, a.finish_reason) == (b.response_ids, b.finish_reason)
