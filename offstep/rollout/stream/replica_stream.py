"""A rollout replica generating without pause (``pipeline.mode=fully_async``): prompt groups come
in whenever the controller admits them, finished groups go out as soon as all their samples are
scored, and weight loads land between decode steps (``offstep.rollout.engines.control``).

The engine's ``serve`` runs on a thread of its own over a :class:`StreamFeed`. A group is ``n``
samples of one prompt; each sample has its own random stream ``(seed, stream0 + j)``, so where and
when it runs does not change what it draws. A sample carries the weight version of each of its
tokens. A suspension (for a checkpoint) hands back every unfinished group with its samples as far
as they got (:class:`SampleState`); submitted again, each continues where it stopped: its prompt
and tokens so far are prefilled, and its stream goes on from the draw it had reached. The samples of
agents' rows (tool loops, OpenAI agents) are loops run by ``offstep.rollout.stream.stream_agents``, whose
model turns are requests of the same feed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from offstep.batch import Sample
from offstep.rollout.engines.control import SUSPENDED, StepControl
from offstep.rollout.engines.replica_schedule import ADMIT, Schedule, request_key
from offstep.rollout.types import Completion, SamplingParams, TurnRequest


@dataclass
class SampleState:
    """One sample of a group as far as it got: its tokens with their log-probs and versions, and,
    once it finished, why and its score."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "": not finished
    score: float | None = None
    extra: dict = field(default_factory=dict)
    text: str = ""
    # an agent's sample (finished: an agent loop's samples are handed over whole, see ``agent_done``)
    loss_mask: list[int] | None = None  # 1: the model's token, 0: a tool turn's
    agent: dict | None = None  # its AgentStats
    info: dict | None = None  # what its reward finds in extra_info besides the row's (num_turns, ...)
    prompt_ids: list[int] | None = None  # its own prompt (an OpenAI agent's rendered chat); None: the row's
    # a tool loop not finished when its group was suspended: its AgentResult (as a dict) at the start of
    # its last model turn; submitted again, the loop goes on from there (offstep.rollout.stream.stream_agents)
    loop: dict | None = None
    kv_age: int = 0  # the most versions its K/V lagged the weights it decoded with (rollout.max_kv_age)


@dataclass
class GroupWork:
    """A prompt group for a replica: the request (``offstep.rollout.replica_spec.Request``), the seed and
    first stream of its samples' random streams, and its samples' states (empty: not started)."""

    request: object
    seed: int
    stream0: int
    samples: list[SampleState] = field(default_factory=list)
    started: float = 0.0  # when the replica first took it (time.time())


@dataclass
class FinishedGroup:
    uid: int
    samples: list[Sample]
    start: float  # the group's generation span on the replica
    end: float
    reward_spans: tuple = ()  # the reward model's batches since the replica's last take (reward.model), for the timeline
    teacher_spans: tuple = ()  # the distillation teacher's batches since the last take (distill.teacher), for the timeline
    sandbox: tuple = ()  # the sandboxed runs since the replica's last take (offstep.sandbox.Execution), for sandbox/*
    tool_spans: tuple = ()  # when the tool loops' tools ran (merged Spans) since the replica's last take, for the timeline
    images: object = None  # its prompt's pixels (ImageInputs), for a reference here; the take drops them


class StreamFeed:
    """The feed of a serving engine that never runs dry: ``take`` blocks until requests arrive, a
    weight load or suspension is posted (it then returns ``[]``, so the engine can act), or the
    feed is closed (``None``). ``pause`` holds back the queued requests (for a suspension).
    ``schedule`` records which requests each take admitted; replaying, a take admits exactly the
    requests due at the coming decode step, waiting for them (``offstep.rollout.engines.replica_schedule``), and
    ``while_waiting`` runs meanwhile (the work posted to the engine's thread)."""

    def __init__(
        self,
        prompts: list[list[int]],
        concurrency: int,
        share_prefix: bool = True,
        schedule: Schedule | None = None,
        while_waiting: Callable[[], None] = lambda: None,
    ):
        self.prompts, self.concurrency, self.share_prefix = prompts, concurrency, share_prefix
        self.schedule, self.while_waiting = schedule, while_waiting
        self._cond = threading.Condition()
        self._queue: list[TurnRequest] = []
        self._closed = self._paused = self._woken = False

    def put(self, requests: list[TurnRequest]) -> None:
        with self._cond:
            self._queue.extend(requests)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def pause(self, paused: bool) -> None:
        with self._cond:
            self._paused = paused
            self._cond.notify_all()

    def drain(self) -> list[TurnRequest]:
        """The queued requests no engine step has taken, removed."""
        with self._cond:
            out, self._queue = self._queue, []
            return out

    @property
    def closed(self) -> bool:
        return self._closed

    def holds(self, keys: list) -> bool:
        """Whether every request named by ``keys`` is queued (or the feed is closed)."""
        with self._cond:
            queued = {tuple(request_key(r)) for r in self._queue}
            return self._closed or all(tuple(k) in queued for k in keys)

    def wait_change(self, timeout: float) -> None:
        """Until requests arrive, a post wakes the feed, or ``timeout`` seconds."""
        with self._cond:
            self._cond.wait(timeout)

    def take(self, limit: int, block: bool) -> list[TurnRequest] | None:
        if self.schedule is not None and self.schedule.replaying:
            return self._take_due(block)
        with self._cond:
            while block and not self._closed and not self._woken and (self._paused or not self._queue):
                self._cond.wait()
            self._woken = False
            if self._closed:
                return None
            if self._paused:
                return []
            out, self._queue = self._queue[:limit], self._queue[limit:]
            if out and self.schedule is not None:
                self.schedule.note(ADMIT, [request_key(r) for r in out])
            return out

    def _take_due(self, block: bool) -> list[TurnRequest] | None:
        """Replaying: the requests admitted before this decode step in the recorded run, in their order."""
        event = self.schedule.due()
        if event is None and block and self.schedule.replaying and not self._closed:
            raise RuntimeError(self.schedule.stuck())  # nothing in flight: the decode step due is never reached
        if event is None or event[1] != ADMIT:  # something else is due first, or nothing
            with self._cond:
                while block and not self._closed and not self._woken:
                    self._cond.wait()
                self._woken = False
                return None if self._closed else []
        while not self.holds(event[2]):
            self.while_waiting()
            self.wait_change(0.05)
        with self._cond:
            if self._closed:
                return None
            by_key = {tuple(request_key(r)): r for r in self._queue}
            out = [by_key[tuple(k)] for k in event[2]]
            taken = {id(r) for r in out}
            self._queue = [r for r in self._queue if id(r) not in taken]
            self.schedule.note(ADMIT, [request_key(r) for r in out])
            return out


class StreamServer:
    """The replica's side of the fully asynchronous mode (see the module's docstring).
    ``score(request, text, extra_info=None) -> (score, extra)`` runs on ``pool``; ``tokenizer``
    decodes texts. ``agents`` maps an ``agent_name`` to what runs its rows' samples
    (``offstep.rollout.stream.stream_agents``): their model turns are requests of this feed (``submit_turn``),
    and each sample comes back whole (``agent_done``)."""

    def __init__(
        self,
        engine,
        prompts: list[list[int]],
        params: SamplingParams,
        partial: str,
        concurrency: int,
        score: Callable,
        pool: ThreadPoolExecutor,
        tokenizer,
        on_sample: Callable[[], None] = lambda: None,
        share_prefix: bool = True,
        replay: list | None = None,
        max_kv_age: int = -1,
        teach: Callable[[list[int], list[int]], Future] | None = None,
        pixels: Callable[[object], object] = lambda request: None,
    ):
        """``teach(prompt_ids, response_ids)``: hands each finished sample to a distillation teacher
        (``offstep.rollout.scoring.teacher_scoring``); its future is kept for the take (``teaching``).
        ``pixels(request)``: its prompt's images as the engine takes them (``offstep.models.vision.ImageInputs``,
        None for a text prompt), given to each of its samples' requests, a continued one's too."""
        self.engine, self.params, self.score, self.pool, self.tok = engine, params, score, pool, tokenizer
        self.on_sample, self.teach, self.pixels = on_sample, teach, pixels
        self.teaching: dict[tuple[int, int], Future] = {}  # (uid, sample index) -> the teacher's answer, until taken
        self.agents: dict[str, object] = {}
        self.control = StepControl(partial, max_kv_age)
        self.schedule = Schedule(
            replay
        )  # when each load, suspension and admission happened (offstep.rollout.engines.replica_schedule)
        self.feed = StreamFeed(prompts, concurrency, share_prefix, self.schedule, self.control.run_posted)
        self.control.use_schedule(self.schedule, self.feed)
        self._lock = threading.Condition()
        self._groups: dict[int, GroupWork] = {}  # uid -> unfinished group
        self._pixels: dict[int, object] = {}  # uid -> its prompt's ImageInputs, while unfinished
        self._owner: dict[int, tuple[int, int]] = {}  # request index -> (uid, sample)
        self._calls: dict[int, Callable[[Completion], None]] = {}  # request index -> an agent's turn's callback
        self._scoring: dict[int, int] = {}  # uid -> samples whose score is pending
        self._finished: list[FinishedGroup] = []
        self._next = 0  # request indices (and engine groups) handed out
        self._error: BaseException | None = None
        self.control.attach(self.feed.wake)
        self._thread = threading.Thread(target=self._serve, name="stream-serve", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.engine.serve(self.feed, self.params, 0, self._on_finish, self.control)
        except BaseException as e:  # handed to the controller by the next take
            with self._lock:
                self._error = e
                self._lock.notify_all()

    # ---------------------------------------------------------------- submitting
    def submit(self, groups: list[GroupWork]) -> None:
        """Queue ``groups``; a group with sample states continues them (finished samples stay)."""
        requests, loops = [], []
        now = time.time()
        with self._lock:
            for g in groups:
                uid = g.request.uid
                if not g.samples:
                    g.samples = [SampleState() for _ in range(self.params.n)]
                g.started = g.started or now
                self._groups[uid] = g
                fresh_key = None  # the fresh samples of one prompt share an engine group: prefilled once
                agent = self.agents.get(g.request.agent_name)
                images = self.pixels(g.request) if g.request.images else None
                if images is not None:
                    self._pixels[uid] = images
                for j, s in enumerate(g.samples):
                    if s.finish_reason:
                        continue
                    if agent is not None:  # an agent's loop: from its start, or (a tool loop) where s.loop stands
                        loops.append((agent, uid, j, g))
                        continue
                    index = self._next
                    self._next += 1
                    if s.tokens:  # a continued sample: its own prompt, the tokens it has
                        group = index
                    else:
                        fresh_key = index if fresh_key is None else fresh_key
                        group = fresh_key
                    self._owner[index] = (uid, j)
                    requests.append(
                        TurnRequest(
                            index,
                            list(g.request.prompt_ids) + s.tokens,
                            g.stream0 + j,
                            self.params.max_new_tokens - len(s.tokens),
                            group,
                            seed=g.seed,
                            offset=len(s.tokens),
                            images=images,
                        )
                    )
                self._scoring[uid] = sum(1 for s in g.samples if s.finish_reason and s.score is None)
                for j, s in enumerate(g.samples):
                    if s.finish_reason and s.score is None:
                        self._score(uid, j)
                self._maybe_done(uid)
        self.feed.put(requests)
        for agent, uid, j, g in loops:
            agent.start(uid, j, g)

    def submit_turn(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stream: int,
        seed: int | None,
        stop: tuple[str, ...] | None,
        on_done: Callable[[int, Completion], None],
        count: int = 1,
    ) -> None:
        """Queue ``count`` samples of one model turn of an agent (streams ``stream``, ``stream + 1``, ...;
        prefilled once); ``on_done(k, completion)`` as sample ``k`` ends, on the engine's thread."""
        with self._lock:
            first = self._next
            self._next += count
            for k in range(count):
                self._calls[first + k] = lambda c, k=k: on_done(k, c)
        self.feed.put(
            [
                TurnRequest(first + k, list(prompt_ids), stream + k, max_new_tokens, first, seed=seed, stop=stop)
                for k in range(count)
            ]
        )

    def agent_done(self, uid: int, j: int, state: SampleState) -> None:
        """Sample ``j`` of group ``uid``, finished by its agent; scored here unless it has its score."""
        with self._lock:
            if uid not in self._groups:
                return
            self._groups[uid].samples[j] = state
            if state.score is None:
                self._scoring[uid] += 1
                self._score(uid, j)
            else:
                self._maybe_done(uid)
        self.on_sample()

    def agent_suspended(self, uid: int, j: int, loop: dict) -> None:
        """Sample ``j`` of group ``uid`` is a tool loop that a suspension stopped: ``loop`` is where it
        goes on from when the group is submitted again."""
        with self._lock:
            if uid in self._groups:
                self._groups[uid].samples[j] = SampleState(loop=loop)

    def fail(self, error: BaseException) -> None:
        """An agent's error: raised by the controller's next take."""
        with self._lock:
            self._error = error
            self._lock.notify_all()

    # ---------------------------------------------------------------- the engine thread
    def _on_finish(self, index: int, c: Completion) -> None:
        with self._lock:
            call = self._calls.pop(index, None)
        if call is not None:
            call(c)
            return
        with self._lock:
            uid, j = self._owner.pop(index)
            g = self._groups[uid]
            s = g.samples[j]
            s.tokens = s.tokens + list(c.response_ids)
            s.logprobs = s.logprobs + list(c.logprobs)
            s.versions = s.versions + list(c.versions)
            s.kv_age = max(s.kv_age, int(c.extra.get("kv_age", 0)))
            if c.finish_reason == SUSPENDED:
                return
            s.finish_reason = c.finish_reason
            self._scoring[uid] += 1
            self._score(uid, j)
        self.on_sample()

    def _score(self, uid: int, j: int) -> None:
        g = self._groups[uid]
        s = g.samples[j]
        s.text = self.tok.decode(s.tokens, skip_special_tokens=True)
        info = {**g.request.extra_info, **s.info} if s.info is not None else None
        if self.teach is not None:
            prompt = g.request.prompt_ids if s.prompt_ids is None else s.prompt_ids
            self.teaching[uid, j] = self.teach(list(prompt), list(s.tokens))
        fut: Future = self.pool.submit(self.score, g.request, s.text, info)
        fut.add_done_callback(lambda f: self._scored(uid, j, f))

    def _scored(self, uid: int, j: int, fut: Future) -> None:
        with self._lock:
            if uid not in self._groups:
                return
            try:
                value, extra = fut.result()
            except BaseException as e:
                self._error = e
                self._lock.notify_all()
                return
            s = self._groups[uid].samples[j]
            s.score, s.extra = value, extra
            self._scoring[uid] -= 1
            self._maybe_done(uid)

    def _maybe_done(self, uid: int) -> None:
        """(Under the lock.) A group whose samples all finished and are scored goes out."""
        g = self._groups[uid]
        if self._scoring[uid] or not all(s.finish_reason and s.score is not None for s in g.samples):
            return
        del self._groups[uid], self._scoring[uid]
        r = g.request
        samples = [
            Sample(
                uid=uid,
                prompt_ids=list(r.prompt_ids if s.prompt_ids is None else s.prompt_ids),
                response_ids=s.tokens,
                rollout_logprobs=s.logprobs,
                finish_reason=s.finish_reason,
                score=s.score,
                version=s.versions[0] if s.versions else self.engine.version,
                data_source=r.data_source,
                text=s.text,
                reward_extra=s.extra,
                token_versions=s.versions,
                loss_mask=s.loss_mask,
                agent=s.agent,
                kv_age=s.kv_age,
            )
            for s in g.samples
        ]
        self._finished.append(FinishedGroup(uid, samples, g.started, time.time(), images=self._pixels.pop(uid, None)))
        self._lock.notify_all()

    # ---------------------------------------------------------------- the controller's calls
    def take(self, wait_s: float) -> list[FinishedGroup]:
        """The groups finished since the last call, waiting up to ``wait_s`` for one."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while not self._finished and self._error is None and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
            if self._error is not None:
                raise self._error
            out, self._finished = self._finished, []
            return out

    def load(self, apply: Callable[[], object]) -> object:
        """Weights into the engine between two decode steps (``apply`` loads them); returns, when done,
        what ``apply`` returned."""
        return self.control.post_load(apply).result()

    def between_steps(self, fn: Callable[[], object]):
        """``fn()`` run by the engine's thread between two decode steps (now, when called from
        that thread); returns its result."""
        if threading.current_thread() is self._thread:
            return fn()
        return self.control.post_work(fn).result()

    def suspend(self) -> list[GroupWork]:
        """End every in-flight sample where it is and hand back every unfinished group (removed
        from this replica; submit them again to continue). Finished groups stay for ``take``. A
        tool loop goes on from the start of its last model turn when submitted again (its earlier
        turns and tool turns kept); an OpenAI agent's rollout starts again from its prompt (a
        Python coroutine cannot be stored)."""
        for agent in self.agents.values():
            agent.forget()
        self.feed.pause(True)
        try:
            self.control.post_suspend().result()
            self.feed.drain()  # their samples' states say where each stands
            with self._lock:
                while any(self._scoring.values()) and self._error is None:
                    self._lock.wait(0.1)
                if self._error is not None:
                    raise self._error
                out = list(self._groups.values())
                self._groups.clear()
                self._pixels.clear()  # computed again when the groups are submitted again
                self._scoring.clear()
                self._owner.clear()
                self._calls.clear()
                return out
        finally:
            self.feed.pause(False)

    def close(self) -> None:
        for agent in self.agents.values():
            agent.close()
        self.feed.close()
        self._thread.join(timeout=30)
