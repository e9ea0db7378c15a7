"""The fully asynchronous mode's source of batches (``pipeline.mode=fully_async``): prompt groups
are admitted into the replicas as the staleness bound allows, finished groups queue in the driver,
and a step takes ``data.train_batch_size`` of them as soon as they are there. The loop, the
trainer, the weight sync and the checkpoints are the batch mode's (``controller.py``).

**Admission** (backpressure, no dropping). Group ``g`` (0, 1, ... in admission order; prompts in
the prompt stream's order) goes to a replica that holds policy version ``h`` only while
``g < (h + k + 1) * B`` (``k = pipeline.max_staleness``, ``B`` groups a step). Its samples' oldest
tokens are then of version ``>= h``.

**Taking a batch** at trainer version ``V`` (the step that makes ``V + 1``): a group admitted at
version ``a`` must be trained by version ``a + k`` (its deadline). The batch takes, earliest
deadline first, as many groups as the later steps could not fit (``must_take``): every group whose
deadline is ``V``, and more where later deadlines crowd. The trainer waits for those if they are
still generating (a long sample is waited for, never dropped: no bias against long samples), and
fills the batch with other finished groups, earliest deadline first. The batch is ordered by
admission number.

With ``k = 0`` exactly ``B`` groups are admitted at each version and all of them are taken, with
the batch mode's seeds and replica shares: the synchronous loop.

Each group's place, seeds and replica are a function of its admission number ``g``: batch
``g // B + 1``, position ``g % B``, the replica whose contiguous share of that batch holds the
position (as ``RolloutFleet.split``), and that replica's generation seed for the batch.

**The schedule** of the run (``offstep.pipeline.replay``): at each step the groups it trains and,
per replica, when its loads, suspensions and admissions happened, into ``schedule.jsonl``. With
``pipeline.replay`` a step trains the recorded groups, and each replica follows its recorded events.

**A replica that dies**, or whose take does not answer within ``rollout.timeout_s``, is replaced by
the fleet (``RolloutFleet.restart``: a new worker with the current weights, within
``rollout.max_restarts``). Its unfinished groups go to the new one as the driver last knew them:
from their prompts, or from the partial samples the last checkpoint stored. The groups it had
finished but not yet handed over are generated again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from offstep.batch import NO_VERSION
from offstep.errors import ConfigError
from offstep.pipeline.dynamic_sampling import Generated
from offstep.pipeline.fleet import gen_seed, split
from offstep.pipeline.inputs import to_request
from offstep.pipeline.replay import SCHEDULE_FILE, read_schedule
from offstep.pipeline.step_metrics import executions_metrics
from offstep.rollout.stream.replica_stream import GroupWork, SampleState
from offstep.telemetry.metrics import JsonlWriter
from offstep.telemetry.names import ResponseLength, Rollout, Stage, Timing, replica, reward_lane

POLL_S = 0.5  # how long one take waits on a replica for a finished group
# The stream's figures of when groups finished (how many wait, how many generate, the lengths of those
# finished since the last step): like wall-clock times, they differ between two runs of one config.
WHEN_FINISHED = (Rollout.QUEUE_DEPTH, Rollout.IN_FLIGHT_GROUPS, Rollout.LENGTH_BIAS, ResponseLength.GENERATED_MEAN)


def must_take(waiting: list, version: int, k: int, B: int) -> int:
    """How many of ``waiting`` (admitted groups not yet trained, in earliest-deadline order: by
    admission version) the batch trained at ``version`` must take, the first ones, so that no
    group ever breaks the bound. Group ``a`` must be trained by version ``a.version + k`` (its
    deadline); the steps after this one, at versions ``version + 1 .. W``, take ``B`` groups each,
    so at most ``(W - version) * B`` groups with a deadline ``<= W`` may be left after it, for every
    ``W``. The answer is at most ``B``: taking this many at every step, and admitting only while
    ``admitted < (held + k + 1) * B`` (every group waiting then has a deadline ``<= held + k``), keep
    the groups waiting with a deadline ``<= W`` at most ``(W - version + 1) * B`` when a batch is
    taken."""
    need = 0
    for i, a in enumerate(waiting):
        last = i + 1 == len(waiting) or waiting[i + 1].version != a.version
        if last:  # the groups with a deadline <= a.version + k: the first i + 1
            need = max(need, i + 1 - (a.version + k - version) * B)
    return need


@dataclass
class Admitted:
    """A group in the stream: its admission number, where it came from, which replica runs it, the
    version that replica held when it was admitted, and its work (finished: its samples)."""

    g: int
    epoch: int
    prompt: int  # index into the training set
    replica: int
    version: int
    work: GroupWork
    finished: object = None  # the replica's FinishedGroup


class SampleStream:
    def __init__(self, cfg, inputs, prompt_stream, workers, params, timeline, restart):
        self.cfg, self.inputs, self.stream, self.workers, self.params = cfg, inputs, prompt_stream, workers, params
        self.timeline = timeline
        self.restart = restart  # RolloutFleet.restart: replace a replica, give it the current weights
        self.B, self.k, self.N = cfg.data.train_batch_size, cfg.pipeline.max_staleness, cfg.trainer.total_steps
        self.R = len(workers.rollout)
        self.shares = [(r, i) for r, part in enumerate(split(list(range(self.B)), self.R)) for i in range(len(part))]
        self.admitted = 0  # groups admitted since the run began (resumed: since its first step)
        self.drawn: list[int] = []  # prompts of the current batch of the prompt stream not admitted yet
        self.epoch = 0
        self.groups: dict[int, Admitted] = {}  # admitted, not yet trained
        self.held = 0  # the policy version every replica holds
        self.generated_lengths: list[int] = []  # lengths of the samples finished since the last batch
        self.reward_spans: list[
            tuple[int, str, object]
        ] = []  # (replica, stage, span): the reward model's and the teacher's batches since the last batch
        self.tool_spans: list[
            tuple[int, object]
        ] = []  # (replica, span) of the tool loops' tools running, since the last batch
        self.executions: list = []  # the sandboxed runs (offstep.sandbox.Execution) since the last batch, for sandbox/*
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._pollers: list[asyncio.Task] = []
        self.holding = False  # admission paused until a checkpoint is written (hold / release)
        self._polling = asyncio.Event()  # cleared while suspended: no take goes out
        self._polling.set()
        self._takes: dict[int, asyncio.Future] = {}  # each replica's take in flight, with its handling
        self._down: set[int] = set()  # replicas being replaced: their groups are submitted by _replace
        self.replay = read_schedule(cfg.pipeline.replay) if cfg.pipeline.replay else None
        self._schedule: JsonlWriter | None = None  # schedule.jsonl (start())
        self._replaced = False  # a replica was replaced since the last step's line

    # ---------------------------------------------------------------- start, admission, polling
    async def start(self, version: int, consumed: int, saved: dict | None) -> None:
        """Start every replica's stream at ``version`` with ``consumed`` groups trained so far;
        ``saved``: the groups a checkpoint stored (:meth:`state`), continued where they stopped."""
        self.held, self.admitted = version, consumed
        self._schedule = JsonlWriter(Path(self.cfg.trainer.output_dir) / SCHEDULE_FILE, append=consumed > 0)
        self._schedule.write({"step": consumed // self.B, "start": True, "replicas": self.R, "batch": self.B})
        if self.replay is not None and (self.replay.replicas, self.replay.batch) != (self.R, self.B):
            raise ConfigError(
                f"pipeline.replay: the recorded run had {self.replay.replicas} replicas and batches of "
                f"{self.replay.batch} groups, this one {self.R} and {self.B}"
            )
        events = self.replay.events if self.replay is not None else [None] * self.R
        await asyncio.gather(*(self._stream_start(w, e) for w, e in zip(self.workers.rollout, events)))
        if saved is not None:
            self._restore(saved)
        self._pollers = [asyncio.ensure_future(self._poll(r)) for r in range(self.R)]
        self.admit()

    async def _stream_start(self, worker, replay: list | None = None) -> None:
        prompts = [p.prompt_ids for p in self.inputs.train]
        await worker.stream_start.remote(
            prompts, self.params, self.cfg.rollout.partial, replay, self.cfg.rollout.max_kv_age
        )

    def _place(self, g: int) -> tuple[int, int, int]:
        """(replica, seed, first stream) of group ``g``: the batch mode's for its batch and position."""
        batch, pos = g // self.B + 1, g % self.B
        r, i = self.shares[pos]
        return r, gen_seed(self.cfg.trainer.seed, batch, r), i * self.params.n

    def admit(self) -> None:
        """Admit every group the staleness bound allows now (see the module's docstring)."""
        if self.holding:
            return
        limit = min(self.N * self.B, (self.held + self.k + 1) * self.B)
        per_replica: dict[int, list[GroupWork]] = {}
        while self.admitted < limit:
            if not self.drawn:
                self.epoch, self.drawn = self.stream.next_batch()
                self.drawn = list(self.drawn)
            g, prompt = self.admitted, self.drawn.pop(0)
            r, seed, stream0 = self._place(g)
            work = GroupWork(to_request(self.inputs.train[prompt], g + self.B), seed, stream0)
            self.groups[g] = Admitted(g, self.epoch, prompt, r, self.held, work)
            per_replica.setdefault(r, []).append(work)
            self.admitted += 1
        for r, works in per_replica.items():
            if r not in self._down:  # a replica being replaced: _replace submits its groups
                self.workers.rollout[r].stream_submit.remote(works)

    async def _poll(self, r: int) -> None:
        timeout = self.cfg.rollout.timeout_s
        try:
            while True:
                await self._polling.wait()
                worker = self.workers.rollout[r]
                self._takes[r] = asyncio.ensure_future(self._take(r, POLL_S))
                try:
                    await asyncio.wait_for(self._takes[r], timeout)
                except asyncio.TimeoutError:
                    await self._replace(r, worker, f"did not answer within rollout.timeout_s={timeout:g}")
                except ray.exceptions.RayActorError as e:
                    await self._replace(r, worker, f"died while generating ({type(e).__name__})")
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self._fail(e)

    async def _replace(self, r: int, failed, why: str) -> None:
        """Replica ``r`` (its worker ``failed``) is replaced, and its unfinished groups go to the
        new one (see the module's docstring). While the stream is suspended for a checkpoint they
        wait for :meth:`resubmit`'s turn, then go here."""
        self._down.add(r)
        self._replaced = True
        try:
            await self.restart(r, failed, why)  # raises RolloutFailed once rollout.max_restarts are used up
            await self._stream_start(self.workers.rollout[r])
            await self._polling.wait()
            works = [
                a.work for a in sorted(self.groups.values(), key=lambda a: a.g) if a.replica == r and a.finished is None
            ]
            if works:
                self.workers.rollout[r].stream_submit.remote(works)
        finally:
            self._down.discard(r)

    async def _take(self, r: int, wait_s: float) -> None:
        for f in await self.workers.rollout[r].stream_take.remote(wait_s):
            self.groups[f.uid - self.B].finished = f
            self.generated_lengths.extend(len(s.response_ids) for s in f.samples)
            self.reward_spans.extend((r, Stage.REWARD_MODEL, span) for span in getattr(f, "reward_spans", ()))
            self.reward_spans.extend((r, Stage.TEACHER, span) for span in getattr(f, "teacher_spans", ()))
            self.tool_spans.extend((r, span) for span in getattr(f, "tool_spans", ()))
            self.executions.extend(getattr(f, "sandbox", ()))
            self._changed.set()

    def _fail(self, e: BaseException) -> None:
        self._error = e
        self._changed.set()

    def loaded(self, version: int) -> None:
        """Every replica now holds ``version`` (its sync was checked): admit what that allows."""
        self.held = max(self.held, version)
        self.admit()

    # ---------------------------------------------------------------- taking a batch
    async def next_batch(self, step: int) -> tuple[Generated, int, list[int], dict]:
        """The ``B`` groups step ``step`` trains on (trainer version ``step - 1``), as the batch
        mode's :class:`Generated`, with their epoch, prompts and the stream's metrics."""
        version = step - 1
        recorded = self.replay.steps.get(step) if self.replay is not None else None
        while recorded is not None:  # replaying: the groups this step trained in the recorded run
            if self._error is not None:
                raise self._error
            gone = [g for g in recorded if g < self.admitted and g not in self.groups]
            if gone:
                raise RuntimeError(
                    f"pipeline.replay: step {step} trained groups {gone}, which this run trained earlier: "
                    "it does not follow the recorded one"
                )
            if all(g in self.groups and self.groups[g].finished is not None for g in recorded):
                chosen = [self.groups[g] for g in recorded]
                break
            self._changed.clear()
            await self._changed.wait()
        while recorded is None:
            if self._error is not None:
                raise self._error
            waiting = sorted(self.groups.values(), key=lambda a: (a.version, a.g))  # earliest deadline first
            must = waiting[: must_take(waiting, version, self.k, self.B)]
            if len(must) > self.B:  # the invariant of must_take's docstring broke: a bug, not a state to train on
                raise RuntimeError(f"step {step}: {len(must)} groups are due, more than data.train_batch_size={self.B}")
            fill = [a for a in waiting[len(must) :] if a.finished is not None][: self.B - len(must)]
            if len(must) + len(fill) == self.B and all(a.finished is not None for a in must):
                chosen = must + fill
                break
            self._changed.clear()
            await self._changed.wait()
        chosen.sort(key=lambda a: a.g)
        await self._record(step, chosen)
        for a in chosen:
            del self.groups[a.g]
        samples = [s for a in chosen for s in a.finished.samples]
        gen = Generated(samples=samples, prompt_of={a.work.request.uid: a.prompt for a in chosen})
        m = self._metrics(chosen, samples, step)
        return gen, max(a.epoch for a in chosen), [a.prompt for a in chosen], m

    async def _record(self, step: int, chosen: list[Admitted]) -> None:
        """The step's line of ``schedule.jsonl``: its groups and each replica's events since the last."""
        live = [r for r in range(self.R) if r not in self._down]
        drained = await asyncio.gather(
            *(self.workers.rollout[r].stream_schedule.remote() for r in live), return_exceptions=True
        )
        events: list[list] = [[] for _ in range(self.R)]
        for r, got in zip(live, drained):
            if isinstance(got, BaseException):  # a replica that died: its poll replaces it
                self._replaced = True
            else:
                events[r] = got
        line = {"step": step, "groups": [a.g for a in chosen], "events": events}
        if self._replaced or len(live) < self.R:
            line["replaced"], self._replaced = True, False
        self._schedule.write(line)

    def _metrics(self, chosen: list[Admitted], samples: list, step: int) -> dict:
        spans = [len(set(s.token_versions or [s.version]) - {NO_VERSION}) for s in samples]  # tool tokens: none
        trained = [len(s.response_ids) for s in samples]
        generated, self.generated_lengths = self.generated_lengths or trained, []
        mean_gen = sum(generated) / len(generated)
        for r in range(self.R):  # each replica's generation of this batch's groups, on the timeline
            mine = [a for a in chosen if a.replica == r]
            if mine:
                self.timeline.add(
                    replica(r),
                    Stage.GEN,
                    step,
                    min(a.finished.start for a in mine),
                    max(a.finished.end for a in mine),
                    version=min(a.version for a in mine),
                )
        busy: dict[tuple[str, int], float] = {}  # seconds in the reward model's and the teacher's batches, per replica
        for r, stage, span in self.reward_spans:  # on the replica's reward lane
            self.timeline.add(reward_lane(r), stage, step, span.start, span.end)
            busy[stage, r] = busy.get((stage, r), 0.0) + span.seconds
        self.reward_spans = []
        scored = {
            key: max(v for (stage, _), v in busy.items() if stage == name)
            for name, key in ((Stage.REWARD_MODEL, Timing.REWARD_MODEL), (Stage.TEACHER, Timing.TEACHER))
            if any(stage == name for stage, _ in busy)
        }
        for r, span in self.tool_spans:  # tools running for the tool loops, on the replica's lane (as in batch mode)
            self.timeline.add(replica(r), Stage.TOOL, step, span.start, span.end)
        self.tool_spans = []
        executions, self.executions = self.executions, []
        gen_s = max(a.finished.end for a in chosen) - min(a.finished.start for a in chosen)
        return {
            Rollout.VERSION_SPAN_MAX: max(spans),
            Rollout.PARTIAL_SAMPLES: sum(n > 1 for n in spans),
            Rollout.KV_AGE_MAX: max(s.kv_age for s in samples),
            Rollout.QUEUE_DEPTH: sum(a.finished is not None for a in self.groups.values()),
            Rollout.IN_FLIGHT_GROUPS: sum(a.finished is None for a in self.groups.values()),
            Rollout.DROPPED_STALE: 0,  # admission holds back instead (see the module's docstring)
            # mean trained length over mean generated length, minus 1: 0 when the batch is not biased
            # towards short (negative) or long (positive) samples
            Rollout.LENGTH_BIAS: (sum(trained) / len(trained)) / max(mean_gen, 1e-9) - 1.0,
            ResponseLength.GENERATED_MEAN: mean_gen,
            Timing.GEN: gen_s,
            **scored,  # the slowest replica's seconds in them, as in batch mode
            **executions_metrics(executions),
        }

    # ---------------------------------------------------------------- checkpoints
    def hold(self) -> None:
        """Admit nothing until :meth:`release`: a step whose checkpoint is due stores the groups
        admitted before it, so that with ``k = 0`` (nothing generating between two steps) a
        checkpoint holds no partial sample and a resume is exact."""
        self.holding = True

    def release(self) -> None:
        self.holding = False
        self.admit()

    async def suspend(self) -> None:
        """Stop every replica's in-flight samples where they are and collect every finished group,
        so that :meth:`state` holds all of them; :meth:`resubmit` continues them. The polls stop
        until then, and the takes they have out are waited for: a take may be carrying finished
        groups that are no longer on the replica (still attaching their reference log-probs)."""
        self._polling.clear()
        live = [r for r in range(self.R) if r not in self._down]
        suspended = await asyncio.gather(
            *(self.workers.rollout[r].stream_suspend.remote() for r in live), return_exceptions=True
        )
        for works in suspended:
            if isinstance(works, ray.exceptions.RayActorError):  # died: its poll replaces it, and the
                continue  # groups are stored as the driver last knew them
            if isinstance(works, BaseException):
                raise works
            for work in works:
                self.groups[work.request.uid - self.B].work = work
        await asyncio.gather(*self._takes.values(), return_exceptions=True)  # a failed one: its poll handles it
        for taken in await asyncio.gather(*(self._take(r, 0.0) for r in live), return_exceptions=True):
            if isinstance(taken, BaseException) and not isinstance(taken, ray.exceptions.RayActorError):
                raise taken

    def resubmit(self) -> None:
        """Continue the suspended groups on their replicas."""
        per_replica: dict[int, list[GroupWork]] = {}
        for a in sorted(self.groups.values(), key=lambda a: a.g):
            if a.finished is None and a.replica not in self._down:  # a replica being replaced: _replace submits
                per_replica.setdefault(a.replica, []).append(a.work)
        for r, works in per_replica.items():
            self.workers.rollout[r].stream_submit.remote(works)
        self._polling.set()

    def state(self) -> dict:
        """The stream's share of a checkpoint (JSON): the prompts drawn but not admitted, and every
        admitted group not yet trained with its samples as far as they got."""
        groups = []
        for a in sorted(self.groups.values(), key=lambda a: a.g):
            if a.finished is not None:
                samples = [dataclasses.asdict(s) for s in a.finished.samples]
                states = None
            else:
                samples = None
                states = [dataclasses.asdict(s) for s in a.work.samples]
            groups.append(
                {
                    "g": a.g,
                    "epoch": a.epoch,
                    "prompt": a.prompt,
                    "replica": a.replica,
                    "version": a.version,
                    "states": states,
                    "samples": samples,
                }
            )
        return {"admitted": self.admitted, "drawn": list(self.drawn), "epoch": self.epoch, "groups": groups}

    def _restore(self, saved: dict) -> None:
        from offstep.pipeline.trainer_state import decode_stream_groups
        from offstep.rollout.stream.replica_stream import FinishedGroup

        self.admitted, self.drawn, self.epoch = saved["admitted"], list(saved["drawn"]), saved["epoch"]
        for d in decode_stream_groups(saved, len(self.inputs.train), self.R):
            r, seed, stream0 = self._place(d["g"])
            work = GroupWork(
                to_request(self.inputs.train[d["prompt"]], d["g"] + self.B),
                seed,
                stream0,
                [SampleState(**s) for s in d["states"]] if d["states"] is not None else [],
            )
            a = Admitted(d["g"], d["epoch"], d["prompt"], r, d["version"], work)
            if d["samples"] is not None:
                a.finished = FinishedGroup(d["g"] + self.B, d["samples"], time.time(), time.time())
            self.groups[a.g] = a
        self.resubmit()

    def close(self) -> None:
        for t in self._pollers:
            t.cancel()
        if self._schedule is not None:
            self._schedule.close()
