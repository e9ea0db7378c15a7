"""The controller: one asyncio loop that owns the order of generation, training and weight sync.

With ``pipeline.max_staleness = k`` generation runs up to k batches ahead of training:

    k = 1   rollout: [gen b1 @v0][gen b2 @v0 ][gen b3 @v1 ][gen b4 @v2 ]...
            trainer:             [train b1 → v1]sync[train b2 → v2]sync...

k = 0 is the synchronous loop. Every sample carries the policy version that generated it (the
rollout worker tags it); ``check_staleness`` (``prepare.py``, as the batch is prepared) is the one place the bound is
enforced.

Off the critical path: a batch is prepared (collated, measured and, when the trainer has nothing
to add, given its advantages and put in the object store) as soon as its samples arrive, while the
trainer still updates on the batch before (``BatchPreparer``); the weight export is queued behind the
actor's update on every rank (``WeightSync.queue``), so no round trip separates the two.

The parts around the loop each have a file: the workers it drives (``workers.py``), the rollout
fleet (``fleet.py``), the weight sync (``weight_sync.py``), checkpoints (``checkpoints.py``), a
step's metrics (``step_metrics.py``) and Ctrl-C handling (``stop.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import ray

from offstep.batch import Span, TrainBatch
from offstep.config.loader import to_yaml
from offstep.config.schema import Config
from offstep.data.stream import PromptStream
from offstep.errors import ConfigError, RolloutFailed, TrainerFailed
from offstep.files import write_file
from offstep.pipeline.advantage import build_kl_controller, needs_old_logprobs
from offstep.pipeline.batching import generate_batch
from offstep.pipeline.checkpoints import Checkpoints, TrainerState, complete_checkpoints, load_failed, phase
from offstep.pipeline.evaluation import summarise
from offstep.pipeline.fleet import RolloutFleet
from offstep.pipeline.inputs import prepare_inputs
from offstep.pipeline.lending import CoreLending
from offstep.pipeline.pools import RoleGroup
from offstep.pipeline.run_dir import open_run
from offstep.pipeline.prepare import BatchPreparer, Prepared
from offstep.pipeline.replay import SCHEDULE_FILE
from offstep.pipeline.step_metrics import record_generation
from offstep.pipeline.stop import StopRequest
from offstep.pipeline.stream import SampleStream
from offstep.pipeline.weight_sync import SyncReport, WeightSync
from offstep.pipeline.workers import Workers, start_workers, worker_failure
from offstep.rollout.types import SamplingParams
from offstep.telemetry.console import ConsoleProgress
from offstep.telemetry.loggers import RunLoggers
from offstep.telemetry.metrics import Timeline, truncate_jsonl
from offstep.telemetry.names import Actor, Perf, Role, Stage, Sync, Timing, Val, actor, critic, replica
from offstep.train.actor import ActorWorker
from offstep.train.critic import CriticWorker
from offstep.train.fsdp import RoleWorker


@dataclass
class InFlight:
    """A batch whose generation has been launched: its position in the stream, the future of its
    :class:`Generated` samples, and the future of its :class:`Prepared` batch."""

    batch_idx: int
    epoch: int
    idx: list[int]  # prompt indices into the training set
    generated: asyncio.Future
    prepared: asyncio.Future | None = None


async def _unless_failed(fut: asyncio.Future, finishing: asyncio.Future | None):
    """``await fut``, unless the records being finished fail first (a weight sync that did not
    arrive): then that error, at once, rather than when the records are next awaited."""
    if finishing is not None:
        await asyncio.wait([fut, finishing], return_when=asyncio.FIRST_COMPLETED)
        if finishing.done() and finishing.exception() is not None:
            raise finishing.exception()
    return await fut


def _check_mode_of(state: TrainerState, cfg: Config, path) -> None:
    """A checkpoint that holds samples generated ahead resumes in the mode that stored them: the
    other mode would not train them, and their prompts would be skipped."""
    stream = state.stream_groups is not None and bool(state.stream_groups.get("groups"))
    stored = "fully_async" if stream else "batch" if state.in_flight else None
    if stored is not None and stored != cfg.pipeline.mode:
        raise ConfigError(f"{path} holds samples generated ahead in pipeline.mode={stored}, which "
                          f"pipeline.mode={cfg.pipeline.mode} would not train (their prompts would be skipped); "
                          f"resume with pipeline.mode={stored}; a checkpoint written with pipeline.max_staleness=0 holds none and "
                          f"resumes in either mode")


def _done(result) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(result)
    return fut


class Controller:
    """Everything that needs no worker is prepared here (config, data, resume point, logs);
    :meth:`start` starts the workers, :meth:`fit` runs the loop, :meth:`close` cleans up."""

    samples: SampleStream | None = None  # pipeline.mode=fully_async: where the batches come from (start())

    def __init__(self, cfg: Config):
        self.cfg, self.k = cfg, cfg.pipeline.max_staleness
        self.out = Path(cfg.trainer.output_dir)
        progress = cfg.trainer.progress if "console" in cfg.trainer.loggers else "off"
        self.console = ConsoleProgress(cfg.trainer.total_steps, progress, cfg.trainer.status_interval_s)
        # Refuses a folder this run does not own (or moves it aside: trainer.overwrite) and picks
        # the intact checkpoint to resume from, before anything is written.
        run = open_run(cfg, self.console.log)
        self.lock = run.lock  # one run per folder, until close()
        try:
            self._prepare_run(run)
        except BaseException:
            self.lock.release()
            raise
        self.workers: Workers | None = None  # set by start()
        self.sync: WeightSync | None = None
        self.fleet: RolloutFleet | None = None

    def _prepare_run(self, run) -> None:
        cfg = self.cfg
        self.checkpoints = Checkpoints(self.out, cfg.trainer.keep_checkpoints, run.run_id)
        self.resume_from = run.resume.path if run.resume is not None else None
        self.resumed: TrainerState | None = run.resume.state if run.resume is not None else None
        if self.resumed is not None:
            _check_mode_of(self.resumed, cfg, self.resume_from)
            for name in ("metrics.jsonl", "timeline.jsonl", "samples.jsonl", SCHEDULE_FILE):
                truncate_jsonl(self.out / name, self.resumed.step)
        write_file(self.out / "config.yaml", to_yaml(cfg))
        self.console.log(f"offstep: preparing data and model ({cfg.model.path})")
        self.inputs = prepare_inputs(cfg, self.out)
        self.stream = PromptStream(len(self.inputs.train), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
        ro = cfg.rollout
        self.params = SamplingParams(n=ro.n, temperature=ro.temperature, top_p=ro.top_p, top_k=ro.top_k,
                                     max_new_tokens=ro.max_new_tokens, stop=tuple(ro.stop),
                                     greedy_baseline=cfg.algorithm.adv_estimator == "remax")
        self.val_params = SamplingParams(n=ro.val_n, temperature=ro.val_temperature, top_p=ro.val_top_p, top_k=ro.val_top_k,
                                         max_new_tokens=ro.max_new_tokens, stop=tuple(ro.stop))
        self.kl_ctrl = build_kl_controller(cfg.algorithm)  # the KL-in-reward coefficient (checkpointed)
        self.loggers = RunLoggers(self.out, cfg, append=self.resumed is not None)
        self.timeline = Timeline(self.out / "timeline.jsonl", t0=self.resumed and self.resumed.t0,
                                 append=self.resumed is not None)
        self.preparer = BatchPreparer(cfg, self.inputs, self.timeline, self.loggers, self.kl_ctrl)
        self.stop = StopRequest(self.console.log)
        self.version = 0  # the trainer's policy version: updates applied
        self.start_step = 0  # the last step already done (> 0 when resuming)
        self.restored: list = []  # batches that were generating when the checkpoint was written
        self.history: list[dict] = []

    def start(self, start=None) -> None:
        """Start the workers (``start(cfg, inputs, console) -> Workers``; the real ones by default)."""
        self.workers = (start or start_workers)(self.cfg, self.inputs, self.console)
        self.sync = WeightSync(self.cfg.pipeline, self.workers)
        lending = CoreLending(self.workers.groups, self.workers.lend_cores) if self.workers.lend_cores else None
        self.fleet = RolloutFleet(self.workers, self.cfg.rollout, self.sync.reload, self.console.log, lending=lending)
        if self.cfg.pipeline.mode == "fully_async":
            self.samples = SampleStream(self.cfg, self.inputs, self.stream, self.workers, self.params, self.timeline,
                                         self.fleet.restart)
        if self.resumed is not None:
            st, roles = self.resumed, self.workers.stateful
            try:
                ray.get([h for g in roles for h in g.submit(RoleWorker.load_checkpoint, str(self.resume_from / g.name))])
            except ray.exceptions.RayTaskError as e:  # damage only a load reveals (garbled, pickled items)
                raise load_failed(self.resume_from, getattr(e, "cause", None) or e) from None
            self.start_step, self.version, self.fleet.restarts = st.step, st.version, st.restarts
            self.stream.load_state_dict(st.stream)
            if st.kl_ctrl is not None and self.kl_ctrl is not None:
                self.kl_ctrl.load_state_dict(st.kl_ctrl)
            self.restored = st.in_flight
            self.console.log(f"offstep: resumed from {self.resume_from} (step {st.step}, policy version {st.version})")

    @property
    def live(self):
        return self.workers.live

    # ---------------------------------------------------------------- the loop
    async def fit(self) -> list[dict]:
        cfg, k, N = self.cfg, self.k, self.cfg.trainer.total_steps
        self.stop.install()
        self.live.start()
        if self.start_step:  # resumed: the rollout workers get the restored policy first
            _, loads = await self.sync.finish(self.version, None)
            await loads
        elif cfg.trainer.val_before_train and self.inputs.val:
            self._emit({"step": 0, "policy_version": 0, **await self._finish_validation(self._start_validation())})
        # Batches already launched when the checkpoint was written come back as they were.
        pending: deque[InFlight] = deque(self._in_flight(b, e, idx, _done(gen)) for b, e, idx, gen in self.restored)
        finishing: asyncio.Future | None = None
        launched = self.start_step + len(pending)
        if self.samples is not None:  # fully_async: the replicas start generating from the prompt stream
            saved = self.resumed.stream_groups if self.resumed is not None else None
            await self.samples.start(self.version, self.start_step * cfg.data.train_batch_size, saved)
        t_step = saved_at = time.time()
        for step in range(self.start_step + 1, N + 1):
            # Keep k batches generating ahead of the one this step consumes (batch mode), or take
            # the step's groups from the stream as they finish (fully_async).
            while self.samples is None and len(pending) <= k and launched < N:
                launched += 1
                pending.append(self._launch(launched))
            assert self.version == step - 1, "batch b is trained at step b by policy b - 1"
            if self.samples is None:
                cur = pending.popleft()
                assert cur.batch_idx == step
                next_ready = cur.prepared
            else:
                next_ready = asyncio.ensure_future(self._take(step))
            t_wait = time.time()
            self.live.note(Role.TRAINER, Stage.WAIT_GEN, step=step)
            ready: Prepared = await _unless_failed(next_ready, finishing)
            wait = time.time() - t_wait
            self.timeline.add(Role.TRAINER, Stage.WAIT_GEN, step, t_wait, time.time())
            batch, m = ready.batch, ready.metrics
            m[Timing.WAIT_GEN] = wait
            async with self.sync.lock:  # from the update until its weights are exported
                update_end = await self._train(ready, step, m)
                self.version += 1
                self.live.note(Role.TRAINER, Stage.SYNC, step=step)
                export, loads = await self.sync.finish(self.version, update_end)
                self.timeline.add(Role.TRAINER, Stage.SYNC_EXPORT, step, export.start, export.end)
            val = None
            if cfg.trainer.val_freq >= 0 and (step == N or (cfg.trainer.val_freq and step % cfg.trainer.val_freq == 0)):
                # Batch mode: queued now, behind the load on every replica. fully_async: a replica
                # serves calls at once, so the validation starts once the loads are checked.
                val = self._start_validation if self.samples is not None else self._start_validation()
            now = time.time()
            m[Timing.STEP], t_step = now - t_step, now
            m[Perf.TOKENS_PER_S] = float(batch.attention_mask.sum()) / m[Timing.STEP]
            m[Perf.SAMPLES_PER_S] = len(batch) / m[Timing.STEP]
            if self.fleet.lending is not None:
                m[Perf.LENT_CORES_S] = self.fleet.lending.take_seconds()
            m["policy_version"] = self.version
            save_freq, saves = cfg.trainer.save_freq, cfg.trainer.save_freq or cfg.trainer.save_last
            saving = (save_freq and step % save_freq == 0) or (saves and (step == N or self.stop.requested)) or (
                0 < cfg.trainer.save_interval_s <= now - saved_at)  # so that a kill loses minutes, not the run
            if saving and self.samples is not None:
                self.samples.hold()  # nothing admitted between this step's sync and its checkpoint
            finishing = asyncio.ensure_future(self._finish_step(m, export.seconds, loads, val, finishing))
            if saving:
                await self._save_checkpoint(step, pending, finishing)
                t_step = saved_at = time.time()  # a save is not part of the next step's time
            if self.stop.requested:
                self.console.log(f"offstep: stopped after step {step}" + (
                    "" if saves else " (no checkpoint: trainer.save_freq=0 and trainer.save_last=false)"))
                break
        if finishing is not None:
            await finishing
        if self.samples is not None:
            self.samples.close()
        await self.live.stop()
        return self.history

    # ---------------------------------------------------------------- rollout
    def _launch(self, batch_idx: int) -> InFlight:
        epoch, idx = self.stream.next_batch()
        return self._in_flight(batch_idx, epoch, idx, generate_batch(  # submitted to the replicas now
            self.fleet.submit, self.inputs.train, self.params, self.cfg.algorithm, self.cfg.trainer.seed, batch_idx, idx))

    def _in_flight(self, batch_idx: int, epoch: int, idx: list[int], generated: asyncio.Future) -> InFlight:
        cur = InFlight(batch_idx, epoch, idx, generated)
        cur.prepared = asyncio.ensure_future(self._prepare(cur))
        return cur

    async def _take(self, step: int) -> Prepared:
        """fully_async: the step's groups from the stream, prepared as a batch mode's batch is."""
        w = self.workers
        gen, epoch, idx, m = await self.samples.next_batch(step)
        ready = self.preparer.prepare(gen, step, epoch, idx, w.ref is not None or w.critic is not None)
        ready.metrics.update(m)
        ready.metrics[Perf.GEN_TOKENS_PER_S] = float(ready.batch.response_mask.sum()) / max(m[Timing.GEN], 1e-9)
        return ready

    async def _prepare(self, cur: InFlight) -> Prepared:
        """The driver's work on a batch as soon as its samples arrive (``prepare.py``); for k >= 1
        usually while the trainer still updates on the batch before."""
        w = self.workers
        trainer_first = w.ref is not None or w.critic is not None  # passes the advantages need
        return self.preparer.prepare(await cur.generated, cur.batch_idx, cur.epoch, cur.idx, trainer_first)

    # ---------------------------------------------------------------- training
    async def _train(self, ready: Prepared, step: int, m: dict) -> float | None:
        """The trainer's stages on a batch; returns when the actor's update ended (``None``: the
        actor did not update), which is when the export of its weights, queued behind it, began."""
        cfg, w = self.cfg, self.workers
        if w.sleeps:  # colocated: the replicas free the devices until the load (rollout.sleep_during_update)
            m[Timing.ROLLOUT_SLEEP] = await self.fleet.sleep(step, self.timeline)
        # Critic warm-up: only the critic trains during the first critic.warmup_steps steps.
        actor_frozen = w.critic is not None and step <= cfg.critic.warmup_steps
        stored = ready.stored if ready.stored is not None else await self._trainer_inputs(ready.batch, step, m, actor_frozen)
        if w.critic is not None:
            cm, span = await self._stage(w.critic, CriticWorker.update, Stage.UPDATE_CRITIC, step, stored)
            m[Timing.UPDATE_CRITIC] = span.seconds
            m.update({critic(k): v for k, v in cm.items()})
            m[Actor.FROZEN] = float(actor_frozen)
        if actor_frozen:
            return None
        update = w.actor.submit(ActorWorker.update, stored)
        self.sync.queue(step)  # the update makes version `step`; its export starts as the update ends
        am, span = await self._stage(w.actor, update, Stage.UPDATE_ACTOR, step)
        m[Timing.UPDATE_ACTOR] = span.seconds
        m.update({actor(k): v for k, v in am.items()})
        return span.end

    async def _trainer_inputs(self, batch: TrainBatch, step: int, m: dict, actor_frozen: bool) -> ray.ObjectRef:
        """The passes over the batch that the advantages need from the trainer workers (reference,
        critic values, pre-update log-probs), then the advantages; returns the batch's object-store ref."""
        w = self.workers
        if w.ref is not None:
            batch.ref_logprobs, span = await self._stage(w.ref, ActorWorker.compute_ref_logprobs, Stage.REF, step, batch)
            m[Timing.REF] = span.seconds
        if w.critic is not None:
            batch.values, span = await self._stage(w.critic, CriticWorker.compute_values, Stage.VALUES, step, batch)
            m[Timing.VALUES] = span.seconds
        if needs_old_logprobs(self.cfg, len(batch), actor_frozen):
            batch.old_logprobs, span = await self._stage(w.actor, ActorWorker.compute_logprobs, Stage.OLD_LOGPROBS, step, batch)
            m[Timing.OLD_LOGPROBS] = span.seconds
        return self.preparer.advantages_and_put(batch, m)

    async def _stage(self, group: RoleGroup, call, stage: str, step: int, *args) -> tuple[object, Span]:
        """Run a method on every rank of ``group`` (``call``: the worker class's method, or the
        calls already submitted); rank 0's result and :class:`Span` (also put on the timeline)."""
        self.live.note(Role.TRAINER, stage, step=step)
        refs = call if isinstance(call, list) else group.submit(call, *args)
        result, span = (await asyncio.gather(*refs))[0]
        self.timeline.add(Role.TRAINER, stage, step, span.start, span.end)
        return result, span

    # ---------------------------------------------------------------- validation and records
    def _start_validation(self) -> asyncio.Future | None:
        if not self.inputs.val:
            return None
        return self.fleet.submit(self.inputs.val, self.val_params, self.cfg.trainer.seed + 1, 0, 10**9, with_ref=False)

    async def _finish_validation(self, fut, step: int = 0) -> dict:
        samples, _, _ = record_generation(self.timeline, await fut, step, stage=Stage.VAL)
        return {**summarise(samples), Val.POLICY_VERSION: samples[0].version}

    async def _finish_step(self, m: dict, export_s: float, loads, val, previous) -> None:
        """Complete a step's record once its weight sync (and validation) are done. Records are
        emitted in step order, since each waits for the previous step's first: a checkpoint relies
        on the metrics of the steps it covers being on disk."""
        if previous is not None:
            await previous
        report: SyncReport = await loads  # raises if a replica does not hold what the trainer sent
        transport = "collective" if report.collective else "object_store"
        for i, r in enumerate(report.loads):
            if r is not None:
                self.timeline.add(replica(i), Stage.LOAD_WEIGHTS, m["step"], r.span.start, r.span.end,
                                  version=r.span.version, transport=transport)
                for wake in r.woke:  # a sleeping replica's wakes (rollout.sleep_during_update)
                    self.timeline.add(replica(i), Stage.WAKE, m["step"], wake.start, wake.end)
        m[Timing.SYNC_WEIGHTS] = export_s + max((r.span.seconds for r in report.loads if r is not None), default=0.0)
        m[Sync.VERIFIED] = float(report.verified)
        m[Timing.SYNC_VERIFY] = report.verify_s  # wall clock: with the other timings, not compared on resume
        m[Sync.COLLECTIVE] = float(report.collective)
        if report.wake_s is not None:  # the replicas slept during the update (rollout.sleep_during_update)
            m[Timing.ROLLOUT_WAKE] = report.wake_s
        if self.samples is not None:  # every replica holds the new version: the stream may admit more
            self.samples.loaded(m["policy_version"])
        if callable(val):
            val = val()
        if val is not None:
            m.update(await self._finish_validation(val, m["step"]))
        self._emit(m)

    def _emit(self, m: dict) -> None:
        self.history.append(m)
        self.loggers.log(m)
        self.console.step(m)

    # ---------------------------------------------------------------- checkpoints
    async def _save_checkpoint(self, step: int, pending: deque[InFlight], finishing) -> None:
        """Write the checkpoint of ``step``: trainer roles' shards, the prompt stream, and the
        batches generating ahead, whose samples are awaited and stored so that a resumed run
        trains on exactly them (neither lost nor generated twice)."""
        t0 = time.time()
        self.console.status(f"step {step}: writing checkpoint")
        await finishing  # this step's metrics are on disk before the checkpoint that covers them
        phase("begin", step)
        in_flight = [(b.batch_idx, b.epoch, b.idx, await b.generated) for b in pending]
        if self.samples is not None:  # every in-flight sample stops where it is, to be stored
            await self.samples.suspend()
        staging = self.checkpoints.staging(step)
        phase("staged", step)  # checkpoints.phase_observers: a kill test holds the write here
        await asyncio.gather(*(g.run(RoleWorker.save_checkpoint, str(staging / g.name)) for g in self.workers.stateful))
        phase("shards", step)
        state = TrainerState(step, self.version, self.timeline.t0, self.stream.state_dict(), in_flight, self.fleet.restarts,
                             self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
                             self.samples.state() if self.samples is not None else None)
        # Its timeline entry goes in before the checkpoint is published: killed just after, a
        # resume from this checkpoint would never write it.
        path = self.checkpoints.commit(staging, state, to_yaml(self.cfg),
                                       lambda: self.timeline.add(Role.TRAINER, Stage.CHECKPOINT, step, t0, time.time()))
        self.console.log(f"offstep: checkpoint {path} ({time.time() - t0:.1f} s)")
        if self.samples is not None:  # the stored samples continue where they stopped
            self.samples.resubmit()
            self.samples.release()

    def close(self, finished: bool = False) -> None:
        """``finished``: the run ended normally, so its workers may be kept for the next run
        (inside ``offstep.pipeline.keep.keep_workers``)."""
        self.console.close()
        self.loggers.close()
        self.timeline.close()
        if self.workers is not None:
            self.workers.close(keep_them=finished)
        self.lock.release()


def train(cfg: Config, start=None) -> list[dict]:
    """Validate, set up, run the loop, clean up. Returns the per-step metrics. ``start`` starts
    the workers (see :meth:`Controller.start`)."""
    from offstep.pipeline.preflight import validate

    validate(cfg)
    ctl = Controller(cfg)
    finished = False
    try:
        ctl.start(start)
        history = asyncio.run(ctl.fit())
        finished = True
        return history
    except ray.exceptions.RayActorError as e:
        role, cause, failed_start = worker_failure(e)
        if failed_start:
            problem = f"the {role} worker failed to start: {cause}. Fix that (the worker's log above has the traceback)"
        else:
            found = complete_checkpoints(ctl.checkpoints.root)
            last = f"the last checkpoint, {found[-1][1]}, is intact: continue with trainer.resume=auto" if found else (
                "no checkpoint was written (set trainer.save_freq to write them as the run goes)")
            problem = f"the {role} worker died: {cause}; {last}"
        raise (RolloutFailed if role.startswith(Role.ROLLOUT) else TrainerFailed)(problem) from e
    finally:
        ctl.close(finished)
