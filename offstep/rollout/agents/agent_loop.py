"""The agent loop: multi-turn rollouts with tools, run by a rollout worker, one loop per sample.

Per sample: generate a turn -> find tool calls in it (``tool_parsers``) -> run the tools
(``tools``) -> append the tool turn's tokens -> generate the next turn from all tokens so far. A
loop ends when a turn has no tool call, after ``max_turns`` model turns (the last turn's calls are
then not run, as verl's ``max_assistant_turns``), or when the sample's response budget
(``rollout.max_new_tokens``, model and tool tokens together, as verl's ``response_length``) is
spent.

Token-in, token-out: the response is the model's tokens exactly as sampled, turn after turn, with
the tool turns' tokens between them; the conversation is never decoded and re-tokenized. A tool
turn's tokens are the chat template's rendering of the tool messages (``ToolTurnRenderer``): the
text the template puts after the assistant's turn (its end-of-turn marker, unless the model
sampled it, the tool messages, the next assistant header), tokenized on its own. ``loss_mask`` is
1 on the model's tokens and 0 on the tool turns', and the rollout log-probs of tool tokens are 0
placeholders: the mask keeps them out of every loss term.

Concurrency: all loops of a generation call share one engine ``serve`` call (``AgentFeed``): a turn
that ends starts its tools on an event loop thread, and the engine keeps decoding the other
samples; the next turn joins the running batch as soon as it is admitted. With ``ordered`` (the
default) the engine admits a tool turn's continuation at its next step, waiting for the tool when
it is not done yet: admission then never depends on timing, so a run (and a resumed one) is
reproducible, at the cost that a slow tool pauses the whole batch. Unordered, continuations join
when their tools finish: a slow tool holds back only its own sample.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from offstep.batch import NO_VERSION, AgentStats
from offstep.config.schema import AgentConfig
from offstep.rollout.agents.agent_tools import agent_tools
from offstep.rollout.agents.tool_parsers import ToolCall, make_parser
from offstep.rollout.agents.tools import Tool, ToolResult, run_tool
from offstep.rollout.engines.control import SUSPENDED, StepControl
from offstep.rollout.engines.plain_generation import finish_target
from offstep.rollout.types import Completion, SamplingParams, TurnRequest


@dataclass
class AgentResult:
    """One sample's loop, as the worker turns it into a ``Sample``."""

    request_pos: int  # which request of the call
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 on tool tokens
    versions: list[int] = field(default_factory=list)  # the version that sampled each token; NO_VERSION on tool tokens
    loss_mask: list[int] = field(default_factory=list)  # 1: the model's token, 0: a tool turn's
    finish_reason: str = "stop"  # "length": the response budget ran out
    text: str = ""  # the whole response, decoded (verl's solution_str)
    final_text: str = ""  # the last model turn, decoded
    turns: int = 0  # model turns
    calls: list[dict] = field(default_factory=list)  # {"name", "arguments", "error", "ran"}
    attempts: int = 0  # turns' call attempts (well-formed or not)
    tool_errors: int = 0
    tool_time_s: float = 0.0
    max_turns_hit: bool = False
    spans: list[tuple[float, float]] = field(default_factory=list)  # when its tool turns ran
    cut: bool = False  # ended by the over-sampling (rollout.over_sample_rate) before it finished: not trained on

    @property
    def ended_by(self) -> str:
        """Why the loop ended: ``"answer"`` (a model turn without a tool call), ``"budget"`` (the
        response budget ran out) or ``"max_turns"`` (the last turn's calls were not run)."""
        if self.finish_reason == "length":
            return "budget"
        return "max_turns" if self.max_turns_hit else "answer"

    def agent_info(self) -> dict:
        """What the reward function finds in ``extra_info`` besides the row's own."""
        return {
            "num_turns": self.turns,
            "tool_calls": self.calls,
            "final_text": self.final_text,
            "ended_by": self.ended_by,
        }


LOOP_LISTS = ("response_ids", "logprobs", "versions", "loss_mask")  # one entry per response token


def resume_loop(stored: dict) -> AgentResult:
    """A loop from ``dataclasses.asdict`` of one (a checkpoint's stream state, checked by
    ``offstep.pipeline.trainer_state``), to go on from."""
    return AgentResult(**{**stored, "spans": [tuple(s) for s in stored.get("spans", [])]})


class ToolTurnRenderer:
    """The tokens of a tool turn as the chat template renders it after an assistant turn."""

    PLACEHOLDER = "OFFSTEP_ASSISTANT_TURN_PLACEHOLDER"

    def __init__(self, tokenizer: Any, role: str, eos_ids: list[int]):
        self.tok, self.role = tokenizer, role
        self.eos_texts = {tokenizer.decode([e]) for e in eos_ids}
        self.eos_ids = set(eos_ids)

    def text(self, results: list[str], model_ended_turn: bool) -> str:
        base = [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": self.PLACEHOLDER},
        ]
        tool_msgs = [{"role": self.role, "content": r} for r in results]
        full = self.tok.apply_chat_template(base + tool_msgs, add_generation_prompt=True, tokenize=False)
        at = full.rfind(self.PLACEHOLDER)
        if at < 0:
            raise ValueError(
                "the chat template does not render an assistant message's content; it cannot frame tool turns"
            )
        suffix = full[at + len(self.PLACEHOLDER) :]
        if model_ended_turn:  # the model sampled the end-of-turn marker itself: keep it its own
            for eos in self.eos_texts:
                if eos and suffix.startswith(eos):
                    return suffix[len(eos) :]
        return suffix

    def tokens(self, results: list[str], last_token: int) -> list[int]:
        text = self.text(results, last_token in self.eos_ids)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])


class AgentFeed:
    """The engine's feed of an agent call: the first turns of every sample, then each loop's next
    turn once its tools have answered (thread-safe: turns end on the engine's thread, tools
    answer on the event loop's)."""

    def __init__(self, prompts: list[list[int]], first: list[TurnRequest], ordered: bool):
        self.prompts, self.ordered = prompts, ordered
        self.concurrency = len(first)  # one turn per loop in flight at most
        self.queue: list[TurnRequest] = list(first)
        self.arrived: list[TurnRequest] = []  # next turns not yet in the queue
        self.active = len(first)  # loops not finished
        self.running = 0  # loops whose tools are running
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.closed = False  # rollout.over_sample_rate met: no turn is taken any more

    def take(self, limit: int, block: bool) -> list[TurnRequest] | None:
        with self.cond:
            while True:
                if self.error is not None:
                    raise self.error
                if self.ordered and self.running:
                    pass  # wait: what is admitted must not depend on how fast a tool is
                elif self.queue or self.arrived or not self.active or not block:
                    break
                self.cond.wait()
            # Ordered: every tool started before this step has answered, so the set that arrived
            # is known; in request order, it is the same whatever the tools' latencies.
            self.queue += sorted(self.arrived, key=lambda r: r.index) if self.ordered else self.arrived
            self.arrived = []
            if not self.queue and not self.active:
                return None
            out, self.queue = self.queue[:limit], self.queue[limit:]
            return out

    def tools_started(self) -> None:
        with self.cond:
            self.running += 1

    def tools_done(self, next_turn: TurnRequest | None) -> None:
        """A loop's tools answered: its next turn, or ``None`` when the loop ended."""
        with self.cond:
            self.running -= 1
            if self.closed:
                pass
            elif next_turn is None:
                self.active -= 1
            else:
                self.arrived.append(next_turn)
            self.cond.notify_all()

    def finished(self) -> None:
        with self.cond:
            if not self.closed:
                self.active -= 1
            self.cond.notify_all()

    def close(self) -> None:
        """Take no turn any more (the loops still open are cut)."""
        with self.cond:
            self.closed, self.queue, self.arrived, self.active = True, [], [], 0
            self.cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.error = error
            self.cond.notify_all()


class AgentRunner:
    """Runs the tool loops of a rollout worker's generation calls (one per worker)."""

    def __init__(self, spec: AgentConfig, tokenizer: Any, eos_ids: list[int]):
        self.spec = spec
        self.tok = tokenizer
        self.tools: dict[str, Tool] = {t.name: t for t in agent_tools(spec)}
        self.parser = make_parser(spec.format, {n: t.schema for n, t in self.tools.items()})
        self.renderer = ToolTurnRenderer(tokenizer, spec.tool_role, list(eos_ids))
        self.executor = ThreadPoolExecutor(max_workers=max(1, spec.tool_threads), thread_name_prefix="tool")
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="agent-tools", daemon=True).start()

    def params(self, params: SamplingParams) -> SamplingParams:
        """The turn's sampling: the call's, also stopping at the end of a tool call."""
        stop = tuple(dict.fromkeys((*params.stop, *self.parser.stop_strings())))
        return dataclasses.replace(params, stop=stop, n=1)

    def run(
        self,
        engine,
        prompts: list[list[int]],
        tools_kwargs: list[dict],
        params: SamplingParams,
        seed: int,
        on_done: Callable[[AgentResult], None] | None = None,
    ) -> list[AgentResult]:
        """``params.n`` loops per prompt, prompt-major (sample ``i`` answers prompt ``i // n``);
        ``tools_kwargs[p]`` are prompt p's per-row tool arguments ({tool: {"create_kwargs": ...}}).
        ``on_done`` is called as each loop ends (from the engine's or the event loop's thread)."""
        n, budget = params.n, params.max_new_tokens
        total = len(prompts) * n
        results = [AgentResult(i // n) for i in range(total)]
        first = [TurnRequest(i, prompts[i // n], i, budget, i // n) for i in range(total)]
        feed = AgentFeed(prompts, first, self.spec.ordered)
        groups = iter(range(len(prompts), 1 << 62))  # continuations: each its own prefill group
        # rollout.over_sample_rate: once ``target`` loops ended, the open ones are cut (their turn in
        # flight ended at the next step boundary, no turn taken after): plain_generation's rule.
        target = finish_target(total, params.over_sample_rate)
        control = StepControl("keep") if target < total else None
        if control is not None:
            control.attach(lambda: None)  # the engine's thread posts it: nothing to wake
        ended: set[int] = set()

        def end(r: AgentResult) -> None:
            r.text = self.tok.decode(r.response_ids, skip_special_tokens=True)
            ended.add(id(r))
            if on_done is not None:
                on_done(r)
            if control is not None and len(ended) >= target and not feed.closed:  # ends on two threads
                feed.close()
                control.post_suspend()

        def on_turn(index: int, c: Completion) -> None:
            i = index % total
            r = results[i]
            prompt = prompts[i // n]
            if c.finish_reason == SUSPENDED or feed.closed:  # cut by the over-sampling
                return
            calls = self.take_turn(r, c)
            if not calls:
                end(r)
                feed.finished()
                return
            feed.tools_started()
            future = self.run_tools(r, calls, tools_kwargs[i // n], c, budget)

            def answered(fut) -> None:
                try:
                    fut.result()
                    if feed.closed:  # cut by the over-sampling while its tools ran
                        feed.tools_done(None)
                        return
                    left = budget - len(r.response_ids)
                    if left <= 0:
                        r.finish_reason = "length"
                        end(r)
                        feed.tools_done(None)
                    else:
                        turn = r.turns
                        feed.tools_done(
                            TurnRequest(turn * total + i, prompt + r.response_ids, i + (turn << 32), left, next(groups))
                        )
                except BaseException as exc:  # a bug here must not leave the engine waiting
                    feed.fail(exc)

            future.add_done_callback(answered)

        try:
            engine.serve(feed, self.params(params), seed, on_turn, control)
        except BaseException:
            feed.fail(RuntimeError("generation stopped"))
            raise
        for r in results:
            r.cut = id(r) not in ended
        return results

    def take_turn(self, r: AgentResult, c: Completion) -> list[ToolCall]:
        """Append model turn ``c`` to loop ``r``; the calls to run next (none: the loop ends here)."""
        r.response_ids += c.response_ids
        r.logprobs += c.logprobs
        r.versions += c.versions
        r.loss_mask += [1] * len(c.response_ids)
        r.turns += 1
        r.final_text = self.tok.decode(c.response_ids, skip_special_tokens=True)
        calls = self.parser.parse(self.tok.decode(c.response_ids, skip_special_tokens=False))
        r.attempts += len(calls)
        if c.finish_reason == "length":
            r.finish_reason = "length"
        if not calls or c.finish_reason == "length" or r.turns >= self.spec.max_turns:
            r.max_turns_hit = bool(calls) and c.finish_reason != "length"
            r.calls += [_call_record(call, None) for call in calls]
            return []
        return calls

    def run_tools(self, r: AgentResult, calls: list[ToolCall], row_kwargs: dict, c: Completion, budget: int):
        """The tool turn after ``c`` on the tools' event loop (a ``concurrent.futures.Future``)."""
        return asyncio.run_coroutine_threadsafe(
            self._tool_turn(r, calls[: self.spec.max_calls_per_turn], row_kwargs, c, budget), self.loop
        )

    async def _tool_turn(
        self, r: AgentResult, calls: list[ToolCall], row_kwargs: dict, c: Completion, budget: int
    ) -> None:
        """Run a turn's calls together; append the tool turn's tokens (cut to the budget left)."""
        t0 = time.time()
        answers: list[ToolResult] = await asyncio.gather(*(self._call(call, row_kwargs) for call in calls))
        r.spans.append((t0, time.time()))
        texts = []
        for call, ans in zip(calls, answers):
            r.tool_time_s += ans.seconds
            r.tool_errors += ans.error
            r.calls.append(_call_record(call, ans))
            texts.append(ans.text[: self.spec.max_tool_response_chars])
        tokens = self.renderer.tokens(texts, c.response_ids[-1] if c.response_ids else -1)
        tokens = tokens[: max(0, budget - len(r.response_ids))]
        r.response_ids += tokens
        r.logprobs += [0.0] * len(tokens)
        r.versions += [NO_VERSION] * len(tokens)
        r.loss_mask += [0] * len(tokens)

    async def _call(self, call: ToolCall, row_kwargs: dict) -> ToolResult:
        if not call.well_formed:
            return ToolResult(f"Error: {call.error}", True, 0.0)
        tool = self.tools[call.name]
        per_row = row_kwargs.get(call.name) or {}
        kwargs = {**(per_row.get("create_kwargs") or {}), **(per_row.get("execute_kwargs") or {})}
        return await run_tool(tool, call.arguments, kwargs, self.spec.tool_timeout_s, self.executor)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.executor.shutdown(wait=False, cancel_futures=True)


def _call_record(call: ToolCall, answer: ToolResult | None) -> dict:
    """A call as the reward function and the metrics see it; ``ran``: the tool was called."""
    return {
        "name": call.name,
        "arguments": call.arguments,
        "well_formed": call.well_formed,
        "error": bool(answer.error) if answer is not None else call.error is not None,
        "ran": answer is not None and call.well_formed,
    }


def merge_spans(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of time intervals, as sorted disjoint intervals (tool time on a rollout lane)."""
    out: list[list[float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def agent_stats(res: AgentResult) -> AgentStats:
    """How loop ``res`` went, as its sample carries it."""
    return AgentStats(
        turns=res.turns,
        tool_calls=sum(c["ran"] for c in res.calls),
        tool_errors=res.tool_errors,
        attempts=res.attempts,
        well_formed=sum(c["well_formed"] for c in res.calls),
        tool_time_s=res.tool_time_s,
        max_turns_hit=res.max_turns_hit,
    )


def run_tool_rows(
    runner: AgentRunner, engine, requests: list, params: SamplingParams, seed: int, reward, pool, progress
) -> tuple[list, tuple]:
    """The samples of tool rows (``replica_spec.Request`` s): ``params.n`` loops each, scored as each
    loop ends by ``reward(request, text, extra_info)`` with the row's ``extra_info`` plus
    ``num_turns``, ``tool_calls`` and ``final_text``; and the merged spans during which tools ran."""
    from offstep.batch import Sample, Span

    version = engine.version
    futures: dict[int, Any] = {}

    def score(res: AgentResult) -> tuple[float, dict]:
        r = requests[res.request_pos]
        return reward(r, res.text, {**r.extra_info, **res.agent_info()})

    def on_done(res: AgentResult) -> None:
        futures[id(res)] = pool.submit(score, res)
        progress.advance()

    results = runner.run(
        engine,
        [r.prompt_ids for r in requests],
        [r.extra_info.get("tools_kwargs") or {} for r in requests],
        params,
        seed,
        on_done,
    )
    samples = []
    for res in results:
        if res.cut:  # rollout.over_sample_rate: not scored, not trained on
            continue
        try:
            value, extra = (futures.get(id(res)) or pool.submit(score, res)).result()
        except BaseException:
            for other in futures.values():
                other.cancel()
            raise
        r = requests[res.request_pos]
        samples.append(
            Sample(
                uid=r.uid,
                prompt_ids=list(r.prompt_ids),
                response_ids=res.response_ids,
                rollout_logprobs=res.logprobs,
                finish_reason=res.finish_reason,
                score=value,
                version=version,
                data_source=r.data_source,
                text=res.text,
                reward_extra=extra,
                loss_mask=res.loss_mask,
                agent=agent_stats(res),
            )
        )
    spans = tuple(Span(a, b) for a, b in merge_spans([s for res in results for s in res.spans]))
    return samples, spans
