"""Agents' rows on a streaming replica (``pipeline.mode=fully_async``, ``offstep.rollout.stream.replica_stream``):
tool loops (``agent_name=tool_agent``, ``offstep.rollout.agents.agent_loop``) and OpenAI agents
(``openai``, ``offstep.rollout.agents.openai_agent``).

Each sample of such a row is a loop whose model turns are requests of the replica's feed
(``StreamServer.submit_turn``): they decode beside the plain samples, and a weight load lands
between two decode steps of a turn like any other sample's, with ``rollout.partial`` deciding how
the turn in flight continues. A finished loop goes back whole as one sample of its group
(``StreamServer.agent_done``): its model tokens carry the version that sampled them, its tool
tokens ``NO_VERSION`` (they are masked). The group leaves when all its samples have.

Where it departs from batch mode: a tool turn's continuation joins the batch when its tools answer
(``rollout.agent.ordered`` is batch mode's); a suspension (a checkpoint) drops the unfinished
loops, which start again from their prompts when their groups are submitted again (a tool's side
effects are not undone); an OpenAI agent's calls draw from random streams of their own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from concurrent.futures import Future

from offstep.batch import Span
from offstep.rollout.agents.agent_loop import AgentResult, AgentRunner, agent_stats, merge_spans, resume_loop
from offstep.rollout.agents.openai_agent import MODEL_NAME, OpenAIRunner
from offstep.rollout.agents.openai_server import OpenAIServer
from offstep.rollout.engines.control import SUSPENDED
from offstep.rollout.stream.replica_stream import GroupWork, SampleState, StreamServer
from offstep.rollout.types import Completion, SamplingParams

CALL_STREAMS = 1 << 48  # an OpenAI call's random streams start here, apart from the samples' own


class ToolLoops:
    """The tool loops of a streaming replica's tool rows (``runner``: the worker's ``AgentRunner``)."""

    def __init__(self, server: StreamServer, runner: AgentRunner, params: SamplingParams):
        self.server, self.runner, self.budget = server, runner, params.max_new_tokens
        self.stop = runner.params(params).stop  # the run's stop strings and the tool parser's
        self._lock = threading.Lock()
        self._live: dict[tuple[int, int], AgentResult] = {}  # (uid, sample) -> its loop
        self._spans: list[tuple[float, float]] = []  # when the finished loops' tools ran, since take_spans
        self._at_turn: dict[tuple[int, int], dict] = {}  # each live loop at the start of its model turn in flight

    def start(self, uid: int, j: int, work: GroupWork) -> None:
        """Sample ``j``'s loop: from the row's prompt, or from where a suspension stopped it."""
        stored = work.samples[j].loop
        r = AgentResult(j) if stored is None else resume_loop(stored)
        with self._lock:
            self._live[(uid, j)] = r
        self._turn(uid, j, work, r)

    def _alive(self, uid: int, j: int, r: AgentResult) -> bool:
        with self._lock:
            return self._live.get((uid, j)) is r

    def _turn(self, uid: int, j: int, work: GroupWork, r: AgentResult) -> None:
        """Loop ``r``'s next model turn: all its tokens so far continued on the sample's stream for
        that turn (``stream0 + j + (turn << 32)``, the batch mode's numbering)."""
        with self._lock:  # not queued once forgotten (a suspension drains what was queued before)
            if self._live.get((uid, j)) is not r:
                return
            self._at_turn[(uid, j)] = {**dataclasses.asdict(r), "spans": []}  # where a suspension goes on from
            self.server.submit_turn(
                list(work.request.prompt_ids) + r.response_ids,
                self.budget - len(r.response_ids),
                work.stream0 + j + (r.turns << 32),
                work.seed,
                self.stop,
                lambda _, c: self._on_turn(uid, j, work, r, c),
            )

    def _on_turn(self, uid: int, j: int, work: GroupWork, r: AgentResult, c: Completion) -> None:
        if c.finish_reason == SUSPENDED or not self._alive(uid, j, r):
            return
        calls = self.runner.take_turn(r, c)
        if not calls:
            self._end(uid, j, r)
            return
        fut = self.runner.run_tools(r, calls, work.request.extra_info.get("tools_kwargs") or {}, c, self.budget)
        fut.add_done_callback(lambda f: self._answered(uid, j, work, r, f))

    def _answered(self, uid: int, j: int, work: GroupWork, r: AgentResult, fut: Future) -> None:
        try:
            fut.result()
        except BaseException as e:  # a bug, not a tool's error (those are answers): the run stops
            if self._alive(uid, j, r):
                self.server.fail(e)
            return
        if len(r.response_ids) >= self.budget:
            r.finish_reason = "length"
            self._end(uid, j, r)
        else:
            self._turn(uid, j, work, r)

    def _end(self, uid: int, j: int, r: AgentResult) -> None:
        with self._lock:
            if self._live.get((uid, j)) is not r:
                return
            del self._live[(uid, j)]
            self._at_turn.pop((uid, j), None)
            self._spans.extend(r.spans)
        self.server.agent_done(
            uid,
            j,
            SampleState(
                tokens=r.response_ids,
                logprobs=r.logprobs,
                versions=r.versions,
                finish_reason=r.finish_reason,
                loss_mask=r.loss_mask,
                agent=dataclasses.asdict(agent_stats(r)),
                info=r.agent_info(),
            ),
        )

    def take_spans(self) -> tuple[Span, ...]:
        """When tools ran for the loops finished since the last call, merged (the timeline's tool stage)."""
        with self._lock:
            spans, self._spans = self._spans, []
        return tuple(Span(a, b) for a, b in merge_spans(spans))

    def forget(self) -> None:
        """A suspension: every unfinished loop is handed to the server as it stood at the start of its
        model turn in flight (that turn and any tools it called run again when it is submitted
        again); what the loops still get back is ignored."""
        with self._lock:
            stopped = [(key, self._at_turn[key]) for key in self._live]
            self._live.clear()
            self._at_turn.clear()
        for (uid, j), loop in stopped:
            self.server.agent_suspended(uid, j, loop)

    close = forget


class StreamBatcher:
    """The OpenAI endpoint's way to a streaming engine (``OpenAIServer.start(batcher=...)``): a
    call's ``n`` choices are ``n`` requests of the replica's feed, sampled with the stream's
    temperature, top-p and top-k, and the call's own token limit and stop strings."""

    def __init__(self, server: StreamServer):
        self.server = server
        self.error: BaseException | None = None
        self._streams = itertools.count(CALL_STREAMS, 1 << 16)  # n <= 2**16 choices a call

    def submit(self, prompt: list[int], params: SamplingParams) -> Future:
        fut: Future = Future()
        run = self.server.params
        if (params.temperature, params.top_p, params.top_k) != (run.temperature, run.top_p, run.top_k):
            fut.set_exception(ValueError("a streaming replica samples with the run's temperature, top_p and top_k"))
            return fut
        out: list[Completion | None] = [None] * params.n
        lock = threading.Lock()

        def done(k: int, c: Completion) -> None:
            if c.finish_reason == SUSPENDED:  # a checkpoint: its rollout is dropped and starts again
                if not fut.done():
                    fut.set_exception(RuntimeError("the call was suspended for a checkpoint"))
                return
            with lock:
                out[k] = c
                finished = all(x is not None for x in out)
            if finished and not fut.done():
                fut.set_result(out)

        self.server.submit_turn(prompt, params.max_new_tokens, next(self._streams), None, params.stop, done, params.n)
        return fut

    def stop(self) -> None:
        pass  # the stream's feed outlives the endpoint's calls


class AgentRollouts:
    """The OpenAI agents of a streaming replica's rows: one endpoint serves for the length of the
    stream, each sample of a row one rollout in a session of its own (``runner``: the worker's)."""

    def __init__(self, server: StreamServer, runner: OpenAIRunner, engine, params: SamplingParams):
        self.server, self.runner = server, runner
        self.endpoint = OpenAIServer(
            engine, runner.tok, runner.eos, runner.spec.format, params.max_new_tokens, (MODEL_NAME,), sampling=params
        ).start(batcher=StreamBatcher(server))
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="openai-agents", daemon=True).start()
        self._http = None  # made on the loop, at the first rollout
        self._lock = threading.Lock()
        self._live: dict[tuple[int, int], Future] = {}

    def start(self, uid: int, j: int, work: GroupWork) -> None:
        with self._lock:
            fut = asyncio.run_coroutine_threadsafe(self._one(work.request), self.loop)
            self._live[(uid, j)] = fut
        fut.add_done_callback(lambda f: self._done(uid, j, work, f))

    async def _one(self, request):
        import httpx

        if self._http is None:
            self._http = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None))
        return await self.runner.rollout(self.endpoint, self._http, request)

    def _done(self, uid: int, j: int, work: GroupWork, fut: Future) -> None:
        with self._lock:
            if self._live.get((uid, j)) is not fut:
                return
            del self._live[(uid, j)]
        try:
            session, result = fut.result()
            s = self.runner.sample(work.request, session, result, self.server.engine.version)
        except BaseException as e:  # the agent raised or returned no reward: the run stops, as in batch mode
            self.server.fail(e)
            return
        self.server.agent_done(
            uid,
            j,
            SampleState(
                tokens=s.response_ids,
                logprobs=s.rollout_logprobs,
                versions=session.trajectory().versions,
                finish_reason=s.finish_reason,
                score=s.score,
                extra=s.reward_extra,
                text=s.text,
                loss_mask=s.loss_mask,
                agent=dataclasses.asdict(s.agent),
                prompt_ids=s.prompt_ids,
            ),
        )

    def forget(self) -> None:
        """Cancel every rollout in flight (a suspension); their sessions close."""
        with self._lock:
            live, self._live = self._live, {}
        for fut in live.values():
            fut.cancel()

    def close(self) -> None:
        self.forget()
        self.endpoint.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


def attach_agents(server: StreamServer, agent_runner, openai_runner, engine, params: SamplingParams) -> None:
    """The agents of a stream's rows (each runner ``None`` when no row needs it)."""
    from offstep.config.choices import OPENAI_AGENT, TOOL_AGENT

    if agent_runner is not None:
        server.agents[TOOL_AGENT] = ToolLoops(server, agent_runner, params)
    if openai_runner is not None:
        server.agents[OPENAI_AGENT] = AgentRollouts(server, openai_runner, engine, params)
