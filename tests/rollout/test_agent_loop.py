"""Multi-turn agent rollouts with tools (offstep.rollout.agents.agent_loop): the tool turn's tokens as the
chat template renders them, the loop's token-in/token-out bookkeeping and stop rules against a
scripted engine, tool failures in the loop, and the real engine continuing from given token ids.
The tools and call formats themselves: test_tools.py. No Ray."""

from __future__ import annotations

import os
import threading
import time

import pytest
from test_tools import tool_file  # noqa: F401 (a fixture)

from offstep.config.schema import AgentConfig
from offstep.rollout.agents.agent_loop import AgentFeed, AgentRunner, ToolTurnRenderer, merge_spans, run_tool_rows
from offstep.rollout.agents.tools import calculator, make_tool
from offstep.rollout.engines.control import SUSPENDED
from offstep.rollout.types import Completion, SamplingParams, TurnRequest

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tok():
    from offstep.models.loading import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model("tiny"))  # SmolLM2's tokenizer and chat template


@pytest.fixture(scope="module")
def eos(tok):
    return [tok.convert_tokens_to_ids("<|im_end|>")]


# ------------------------------------------------------------------ the tool turn's tokens


def test_tool_turn_is_what_the_chat_template_renders(tok, eos):
    """prompt + model turn + tool turn + model turn, as token ids, decodes to exactly the chat
    template's rendering of those messages: the tool turn frames the model's turns as the template
    does, whether the model ended its turn with <|im_end|> or at the stop string."""
    r = ToolTurnRenderer(tok, "tool", eos)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "What is 47 * 86?"}]
    prompt = tok(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    ).input_ids
    for first, ended in (
        ("<calculator>47 * 86</calculator>", False),
        ("<calculator>47 * 86</calculator><|im_end|>", True),
    ):
        turn1 = tok(first, add_special_tokens=False).input_ids
        tool = r.tokens(["4042"], turn1[-1])
        turn2 = tok("The answer is 4042.<|im_end|>", add_special_tokens=False).input_ids
        got = tok.decode(prompt + turn1 + tool + turn2)
        want = tok.apply_chat_template(
            msgs
            + [
                {"role": "assistant", "content": "<calculator>47 * 86</calculator>"},
                {"role": "tool", "content": "4042"},
                {"role": "assistant", "content": "The answer is 4042."},
            ],
            tokenize=False,
        )
        assert got == want.rstrip("\n"), (ended, got)  # the template's trailing newline follows the last eos
    assert r.text(["4042"], model_ended_turn=True) == "\n<|im_start|>tool\n4042<|im_end|>\n<|im_start|>assistant\n"
    assert ToolTurnRenderer(tok, "user", eos).text(["4042"], True).startswith("\n<|im_start|>user\n4042")


# ------------------------------------------------------------------ the loop against a scripted engine


class ScriptedEngine:
    """An engine whose turns are given: ``script(request) -> text`` of that turn (cut to the
    request's token limit, ``finish_reason="length"`` then). Records every request it serves."""

    def __init__(self, tok, eos, script):
        self.tok, self.eos, self.script, self.version = tok, eos, script, 3
        self.requests: list[TurnRequest] = []

    def serve(self, feed, params, seed, on_finish, control=None):
        """``control``: a suspension posted between two turns ends the turns taken and not yet
        answered (``suspended``), as an engine's step boundary does."""
        while (new := feed.take(8, block=True)) is not None:
            for k, req in enumerate(new):
                if control is not None and control.pending() == "suspend":
                    for rest in new[k:]:
                        on_finish(rest.index, Completion(rest.group, [], [], SUSPENDED))
                    control.run_suspend()
                    break
                self.requests.append(req)
                ids = self.tok(self.script(req), add_special_tokens=False).input_ids
                reason = "stop"
                if len(ids) > req.max_new_tokens:
                    ids, reason = ids[: req.max_new_tokens], "length"
                lps = [-0.5 - 0.01 * k for k in range(len(ids))]
                on_finish(
                    req.index, Completion(req.group, ids, lps, reason, self.tok.decode(ids, skip_special_tokens=True))
                )
        if control is not None:
            control.detach()


def _calc_script(tok):
    def script(req):
        text = tok.decode(req.prompt_ids)
        if "<|im_start|>tool" not in text.split("What is")[-1]:
            return "<calculator>47 * 86</calculator>"
        return "47 * 86 = 4042.<|im_end|>"

    return script


def _prompt(tok, q="What is 47 * 86?"):
    msgs = [{"role": "system", "content": "calc"}, {"role": "user", "content": q}]
    return tok(
        tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    ).input_ids


def test_loop_token_in_token_out_and_mask(tok, eos):
    spec = AgentConfig(max_turns=4)
    runner = AgentRunner(spec, tok, eos)
    engine = ScriptedEngine(tok, eos, _calc_script(tok))
    prompt = _prompt(tok)
    (res,) = runner.run(engine, [prompt], [{}], SamplingParams(n=1, max_new_tokens=64), seed=0)
    turn1 = tok("<calculator>47 * 86</calculator>", add_special_tokens=False).input_ids
    tool = ToolTurnRenderer(tok, "tool", eos).tokens(["4042"], turn1[-1])
    turn2 = tok("47 * 86 = 4042.<|im_end|>", add_special_tokens=False).input_ids
    # The response is the model's ids as sampled, then the tool turn's, then the model's again.
    assert res.response_ids == turn1 + tool + turn2
    assert res.loss_mask == [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2)
    # Rollout log-probs: the engine's for model tokens, 0 placeholders on tool tokens.
    assert res.logprobs == [-0.5 - 0.01 * k for k in range(len(turn1))] + [0.0] * len(tool) + [
        -0.5 - 0.01 * k for k in range(len(turn2))
    ]
    # The second turn continues from the given ids (never re-tokenized), within the budget left,
    # on its own random stream; the first turn uses the sample's own (as plain generation does).
    first, second = engine.requests
    assert first.prompt_ids == prompt and first.stream == 0 and first.max_new_tokens == 64
    assert second.prompt_ids == prompt + turn1 + tool and second.max_new_tokens == 64 - len(turn1) - len(tool)
    assert second.stream == 0 + (1 << 32)
    assert (res.turns, res.attempts, res.tool_errors, res.finish_reason) == (2, 1, 0, "stop")
    assert res.final_text == "47 * 86 = 4042." and res.ended_by == "answer"
    assert res.agent_info()["num_turns"] == 2 and res.agent_info()["tool_calls"][0]["arguments"] == {
        "expression": "47 * 86"
    }
    runner.close()


def test_loop_stops_at_max_turns_without_running_the_call(tok, eos):
    runner = AgentRunner(AgentConfig(max_turns=1), tok, eos)
    engine = ScriptedEngine(tok, eos, lambda req: "<calculator>1+1</calculator>")
    (res,) = runner.run(engine, [_prompt(tok)], [{}], SamplingParams(max_new_tokens=64), seed=0)
    assert res.turns == 1 and res.max_turns_hit and res.loss_mask == [1] * len(res.response_ids)
    assert res.ended_by == "max_turns"
    assert res.calls[0]["ran"] is False and len(engine.requests) == 1
    runner.close()


def test_loop_budget_cuts_the_tool_turn_and_ends(tok, eos):
    turn1 = tok("<calculator>47 * 86</calculator>", add_special_tokens=False).input_ids
    budget = len(turn1) + 3  # room for 3 of the tool turn's tokens, none for another model turn
    runner = AgentRunner(AgentConfig(), tok, eos)
    engine = ScriptedEngine(tok, eos, _calc_script(tok))
    (res,) = runner.run(engine, [_prompt(tok)], [{}], SamplingParams(max_new_tokens=budget), seed=0)
    assert len(res.response_ids) == budget and res.finish_reason == "length"
    assert res.loss_mask == [1] * len(turn1) + [0, 0, 0] and len(engine.requests) == 1
    assert res.ended_by == "budget"
    runner.close()


def test_tool_errors_go_back_to_the_model_and_the_loop_goes_on(tok, eos, tool_file):
    spec = AgentConfig(tools=["boom"], tools_path=tool_file, max_turns=3)
    runner = AgentRunner(spec, tok, eos)

    def script(req):
        return "ok<|im_end|>" if "Error" in tok.decode(req.prompt_ids) else "<boom>x</boom>"

    engine = ScriptedEngine(tok, eos, script)
    (res,) = runner.run(engine, [_prompt(tok)], [{}], SamplingParams(max_new_tokens=80), seed=0)
    assert "Error: RuntimeError: kaput" in tok.decode(res.response_ids) and res.tool_errors == 1 and res.turns == 2
    runner.close()


def _by_request(rule):
    """``rule`` (verl's signature) as the worker's ``reward(request, text, extra_info)``."""
    return lambda r, text, extra_info: rule(r.data_source, text, r.ground_truth, extra_info)


def test_rows_tools_kwargs_reach_the_tool_and_extra_info_reaches_the_reward(tok, eos, tool_file):
    """verl's extra_info.tools_kwargs: {tool: {"create_kwargs": {...}}} per row."""
    from concurrent.futures import ThreadPoolExecutor

    from offstep.rollout.replica_spec import Request
    from offstep.telemetry.progress import ProgressClient

    runner = AgentRunner(AgentConfig(tools=["lookup"], tools_path=tool_file, max_turns=2), tok, eos)

    def script(req):
        return "<lookup>k</lookup>" if "tool" not in tok.decode(req.prompt_ids[-30:]) else "done<|im_end|>"

    seen = []

    def reward(request, solution_str, extra_info):
        seen.append(extra_info)
        return 1.0, {}

    rows = [
        Request(
            uid=7,
            prompt_ids=_prompt(tok),
            data_source="d",
            ground_truth="g",
            agent_name="tool_agent",
            extra_info={"index": 3, "tools_kwargs": {"lookup": {"create_kwargs": {"table": {"k": "secret-7"}}}}},
        )
    ]
    samples, spans = run_tool_rows(
        runner,
        ScriptedEngine(tok, eos, script),
        rows,
        SamplingParams(n=2, max_new_tokens=64),
        0,
        reward,
        ThreadPoolExecutor(1),
        ProgressClient(),
    )
    assert len(samples) == 2 and all("secret-7" in tok.decode(s.response_ids) for s in samples)
    assert samples[0].agent.turns == 2 and samples[0].agent.tool_calls == 1 and samples[0].version == 3
    assert seen[0]["index"] == 3 and seen[0]["num_turns"] == 2 and seen[0]["tool_calls"][0]["name"] == "lookup"
    assert spans and all(s.end >= s.start for s in spans)
    runner.close()


def test_calculator_reward_counts_only_a_plain_final_answer(tok, eos):
    """The calculator task's scorer (the same for training, validation and ``offstep eval``) on real
    loops: the right number in a plain final turn scores 1, with or without a tool result before it;
    the right number in a second call (run out of turns, or cut by the token budget) scores 0."""
    from concurrent.futures import ThreadPoolExecutor

    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import Request
    from offstep.telemetry.progress import ProgressClient

    after_tool = _calc_script(tok)  # call, then "47 * 86 = 4042.<|im_end|>"

    def call_again(req):
        return "<calculator>4042</calculator>"

    scripts = {
        "after_tool": after_tool,
        "no_tool": lambda req: "It is 4042.<|im_end|>",
        "max_turns": call_again,
        "budget": call_again,
    }
    call = tok("<calculator>4042</calculator>", add_special_tokens=False).input_ids
    first_two = len(call) + len(ToolTurnRenderer(tok, "tool", eos).tokens(["4042"], call[-1]))
    got = {}
    for case, script in scripts.items():
        budget = (
            first_two + 5 if case == "budget" else 128
        )  # "budget": the call and its tool turn fit, not the next call
        runner = AgentRunner(AgentConfig(max_turns=2), tok, eos)
        rows = [Request(0, _prompt(tok), "calculator", "4042", {"index": 0}, "tool_agent")]
        (s,), _ = run_tool_rows(
            runner,
            ScriptedEngine(tok, eos, script),
            rows,
            SamplingParams(max_new_tokens=budget),
            0,
            _by_request(RewardFunction()),
            ThreadPoolExecutor(1),
            ProgressClient(),
        )
        runner.close()
        got[case] = (s.score, s.agent.turns, s.finish_reason)
    assert got == {
        "after_tool": (1.0, 2, "stop"),
        "no_tool": (1.0, 1, "stop"),
        "max_turns": (0.0, 2, "stop"),
        "budget": (0.0, 2, "length"),
    }


def test_ordered_feed_admits_the_same_way_whatever_the_tools_latency(tok, eos):
    """With ``ordered`` a continuation is admitted at the step after its turn ended, whatever its
    tool's latency: the sequence of engine takes is the same run after run."""
    import random

    def slow_calc(expression: str) -> str:
        """Calculator with a random latency.

        Args:
            expression: arithmetic
        """
        time.sleep(random.random() * 0.05)
        return calculator(expression)

    def takes():
        runner = AgentRunner(AgentConfig(), tok, eos)
        runner.tools = {"calculator": make_tool(slow_calc)}  # the parser knows it as "calculator"
        engine = ScriptedEngine(tok, eos, _calc_script(tok))
        log = []
        original = engine.serve

        def serve(feed, params, seed, on_finish, control=None):
            take = feed.take

            def logged(limit, block):
                out = take(2, block)
                log.append(None if out is None else [r.index for r in out])
                return out

            feed.take = logged
            original(feed, params, seed, on_finish, control)

        engine.serve = serve
        runner.run(
            engine,
            [_prompt(tok, f"What is {a} * 7?") for a in range(5)],
            [{}] * 5,
            SamplingParams(n=2, max_new_tokens=64),
            0,
        )
        runner.close()
        return log

    assert takes() == takes() == takes()


@pytest.mark.parametrize("ordered", [False, True])
def test_unordered_feed_lets_fast_loops_pass_a_slow_tool(tok, eos, ordered):
    """``ordered=false`` promises that a slow tool holds back only its own sample: the fast
    sample's next turn is admitted (and here served) while the slow tool still runs; ``ordered``
    waits for every running tool first. The loops' tokens are the same either way: only the
    admission order differs."""
    release, released = threading.Event(), []

    def gated(expression: str) -> str:
        """A tool whose "slow" call runs until the engine serves the fast sample's next turn.

        Args:
            expression: slow or fast
        """
        if expression == "slow":
            released.append(release.wait(timeout=0.5 if ordered else 10))
        return "7"

    def script(req):
        text = tok.decode(req.prompt_ids)
        which = "slow" if "slow?" in text else "fast"
        if "<|im_start|>tool" not in text.split("What is")[-1]:
            return f"<calculator>{which}</calculator>"
        if which == "fast":
            release.set()
        return f"{which} done.<|im_end|>"

    runner = AgentRunner(AgentConfig(ordered=ordered), tok, eos)
    runner.tools = {"calculator": make_tool(gated)}  # the parser knows it as "calculator"
    engine = ScriptedEngine(tok, eos, script)
    results = runner.run(
        engine,
        [_prompt(tok, "What is slow?"), _prompt(tok, "What is fast?")],
        [{}, {}],
        SamplingParams(max_new_tokens=64),
        0,
    )
    runner.close()
    served = [("slow" if "slow?" in tok.decode(r.prompt_ids) else "fast") for r in engine.requests]
    # Unordered: the fast continuation goes first and releases the slow tool; ordered: the slow
    # tool runs out its 0.5 s, then both continuations are admitted together, in request order.
    assert served == (["slow", "fast", "slow", "fast"] if ordered else ["slow", "fast", "fast", "slow"])
    assert released == [not ordered]
    for r, which in zip(results, ("slow", "fast")):
        call = tok(f"<calculator>{which}</calculator>", add_special_tokens=False).input_ids
        tool = ToolTurnRenderer(tok, "tool", eos).tokens(["7"], call[-1])
        assert r.response_ids == call + tool + tok(f"{which} done.<|im_end|>", add_special_tokens=False).input_ids
        assert (r.turns, r.ended_by, r.loss_mask.count(0)) == (2, "answer", len(tool))


def test_feed_error_reaches_the_engine():
    feed = AgentFeed([[1]], [], ordered=True)
    feed.active = 1
    feed.tools_started()
    threading.Timer(0.05, feed.fail, args=(RuntimeError("bug"),)).start()
    with pytest.raises(RuntimeError, match="bug"):
        feed.take(1, block=True)


def test_merge_spans():
    assert merge_spans([(3, 4), (0, 1), (0.5, 2), (4, 5)]) == [(0, 2), (3, 5)]


# ------------------------------------------------------------------ the real engine continues from given ids


@pytest.mark.heavy
def test_builtin_engine_serves_continuations_from_given_ids(tok, eos):
    from agent_helpers import check_serves_continuation

    from offstep.models.loading import load_causal_lm, resolve_model
    from offstep.rollout.engines.torch_engine import TorchEngine

    model = load_causal_lm(resolve_model("tiny"))
    check_serves_continuation(TorchEngine(model, tok, eos), model, tok, atol=1e-4)


def test_a_loop_without_calls_is_the_single_turn_sample(tmp_path):
    """A tool row whose model writes no call is the plain row's sample: the same tokens, log-probs,
    score and text (the first turn draws from the sample's own stream); it only gains loop stats."""
    from offstep.config.schema import AgentConfig
    from offstep.models.loading import resolve_model
    from offstep.rewards.registry import RewardFunction
    from offstep.rollout.replica_spec import Request, RolloutSpec
    from offstep.rollout.worker import RolloutWorker

    path = resolve_model("tiny")
    worker = RolloutWorker(RolloutSpec.local(path, RewardFunction(), 16, agent=AgentConfig()))
    prompts = [_prompt(worker._tok, q) for q in ("What is 3 + 4?", "What is 12 + 30?")]
    p = SamplingParams(n=2, temperature=1.0, max_new_tokens=12)
    rows = lambda agent: [Request(i, ids, "arithmetic", "7", {}, agent) for i, ids in enumerate(prompts)]  # noqa: E731
    plain, _ = worker.generate(rows("single_turn_agent"), p, seed=11)
    looped, _ = worker.generate(rows("tool_agent"), p, seed=11)
    assert all(s.agent.turns == 1 and s.agent.attempts == 0 for s in looped)
    for a, b in zip(plain, looped):
        assert (a.uid, a.response_ids, a.rollout_logprobs, a.score, a.text) == (
            b.uid,
            b.response_ids,
            b.rollout_logprobs,
            b.score,
            b.text,
        )
        assert a.loss_mask is None and b.loss_mask == [1] * len(b.response_ids)
    # A mixed call: plain rows as plain generation, tool rows through their loops, in request order.
    mixed, _ = worker.generate([rows("single_turn_agent")[0], rows("tool_agent")[1]], p, seed=11)
    assert [s.uid for s in mixed] == [0, 0, 1, 1] and mixed[0].agent is None and mixed[2].agent is not None
