"""The controller: one asyncio loop that owns the order of generation, training and weight sync.

With ``pipeline.max_staleness = k`` generation runs up to k batches ahead of training:

    k = 1   rollout: [gen b1 @v0][gen b2 @v0 ][gen b3 @v1 ][gen b4 @v2 ]...
            trainer:             [train b1 → v1]sync[train b2 → v2]sync...

k = 0 is the synchronous loop; ``pipeline.mode=fully_async`` takes a step's groups from a stream
instead of whole batches, and the loop is the same. Every sample carries the policy version that
generated it; ``check_staleness`` (``prepare.py``) is the one place the bound is enforced.

The parts around the loop each have a file: where a step's batch comes from, prepared off the
critical path, in either mode (``batch_source.py``), the trainer's stages on it (``train_stages.py``),
the workers (``workers.py``), the rollout fleet (``fleet.py``), the weight sync
(``weight_sync.py``), checkpoints (``checkpoints.py``), a step's metrics (``step_metrics.py``)
and Ctrl-C handling (``stop.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import ray

from offstep.config.schema import Config, to_yaml
from offstep.data.prompt_stream import PromptStream
from offstep.files import write_file
from offstep.pipeline.batch_source import BatchSource, check_mode_of, make_source, sampling_params, unless_failed
from offstep.pipeline.checkpoints import Checkpoints, TrainerState, complete_checkpoints, load_failed
from offstep.pipeline.compute_advantages import build_kl_controller
from offstep.pipeline.evaluation import summarise
from offstep.pipeline.fleet import RolloutFleet
from offstep.pipeline.inputs import prepare_inputs
from offstep.pipeline.lending import CoreLending
from offstep.pipeline.prepare import BatchPreparer, Prepared
from offstep.pipeline.replay import SCHEDULE_FILE
from offstep.pipeline.run_dir import open_run
from offstep.pipeline.step_metrics import StepRecord, record_generation
from offstep.pipeline.stop import StopRequest
from offstep.pipeline.train_stages import TrainerStages
from offstep.pipeline.weight_sync import SyncReport, WeightSync
from offstep.pipeline.workers import Workers, failure, start_workers
from offstep.telemetry.console import ConsoleProgress
from offstep.telemetry.loggers import RunLoggers
from offstep.telemetry.metrics import Timeline, truncate_jsonl
from offstep.telemetry.names import Perf, Role, Stage, Timing, Val
from offstep.train.fsdp import RoleWorker


class Controller:
    """Everything that needs no worker is prepared here (config, data, resume point, logs);
    :meth:`start` starts the workers, :meth:`fit` runs the loop, :meth:`close` cleans up."""

    def __init__(self, cfg: Config, on_phase: Callable[[str, int], None] | None = None):
        """``on_phase``: called at each phase of a checkpoint write (``Checkpoints``; the kill tests)."""
        self.cfg, self.on_phase = cfg, on_phase
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
        self.source: BatchSource | None = None  # where the batches come from

    def _prepare_run(self, run) -> None:
        cfg = self.cfg
        self.checkpoints = Checkpoints(
            self.out,
            cfg.trainer.keep_checkpoints,
            run.run_id,
            cfg.trainer.best_metric if cfg.trainer.keep_best else None,
            self.on_phase,
        )
        self.resume_from = run.resume.path if run.resume is not None else None
        self.resumed: TrainerState | None = run.resume.state if run.resume is not None else None
        if self.resumed is not None:
            check_mode_of(self.resumed, cfg, self.resume_from)
            for name in ("metrics.jsonl", "timeline.jsonl", "samples.jsonl", SCHEDULE_FILE):
                truncate_jsonl(self.out / name, self.resumed.step)
        write_file(self.out / "config.yaml", to_yaml(cfg))
        self.console.log(f"offstep: preparing data and model ({cfg.model.path})")
        self.inputs = prepare_inputs(cfg, self.out)
        self.stream = PromptStream(
            len(self.inputs.train), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle
        )
        self.params, self.val_params = sampling_params(cfg)
        self.kl_ctrl = build_kl_controller(cfg.algorithm)  # the KL-in-reward coefficient (checkpointed)
        self.loggers = RunLoggers(self.out, cfg, append=self.resumed is not None)
        self.timeline = Timeline(
            self.out / "timeline.jsonl", t0=self.resumed and self.resumed.t0, append=self.resumed is not None
        )
        self.preparer = BatchPreparer(cfg, self.inputs, self.timeline, self.loggers, self.kl_ctrl)
        self.stop = StopRequest(self.console.log)
        self.version = 0  # the trainer's policy version: updates applied
        self.start_step = 0  # the last step already done (> 0 when resuming)
        self.history: list[dict] = []

    def start(self, start=None) -> None:
        """Start the workers (``start(cfg, inputs, console) -> Workers``; the real ones by default)."""
        self.workers = (start or start_workers)(self.cfg, self.inputs, self.console)
        self.sync = WeightSync(self.cfg.pipeline, self.workers)
        lending = CoreLending(self.workers.groups, self.workers.lend_cores) if self.workers.lend_cores else None
        self.fleet = RolloutFleet(self.workers, self.cfg.rollout, self.sync.reload, self.console.log, lending=lending)
        self.source = make_source(
            self.cfg, self.inputs, self.stream, self.workers, self.fleet, self.params, self.timeline, self.preparer
        )
        self.trainer = TrainerStages(self.cfg, self.workers, self.fleet, self.sync, self.preparer, self.timeline)
        if self.resumed is not None:
            st, roles = self.resumed, self.workers.stateful
            try:
                ray.get(
                    [h for g in roles for h in g.submit(RoleWorker.load_checkpoint, str(self.resume_from / g.name))]
                )
            except ray.exceptions.RayTaskError as e:  # damage only a load reveals (garbled, pickled items)
                raise load_failed(self.resume_from, getattr(e, "cause", None) or e) from None
            self.start_step, self.version, self.fleet.restarts = st.step, st.version, st.restarts
            self.stream.load_state_dict(st.stream)
            if st.kl_ctrl is not None and self.kl_ctrl is not None:
                self.kl_ctrl.load_state_dict(st.kl_ctrl)
            self.console.log(f"offstep: resumed from {self.resume_from} (step {st.step}, policy version {st.version})")

    @property
    def live(self):
        return self.workers.live

    # ---------------------------------------------------------------- the loop
    async def fit(self) -> list[dict]:
        cfg, N = self.cfg, self.cfg.trainer.total_steps
        self.stop.install()
        self.live.start()
        if self.start_step:  # resumed: the rollout workers get the restored policy first
            _, loads = await self.sync.finish(self.version, None)
            await loads
        elif cfg.trainer.val_before_train and self.inputs.val:
            self._emit({"step": 0, "policy_version": 0, **await self._finish_validation(self._start_validation())})
        await self.source.start(self.version, self.start_step, self.resumed)
        finishing: asyncio.Future | None = None
        t_step = saved_at = time.time()
        for step in range(self.start_step + 1, N + 1):
            assert self.version == step - 1, "batch b is trained at step b by policy b - 1"
            next_ready = self.source.next(step)  # k batches generating ahead, or the stream's finished groups
            t_wait = time.time()
            self.live.note(Role.TRAINER, Stage.WAIT_GEN, step=step)
            ready: Prepared = await unless_failed(next_ready, finishing)
            wait = time.time() - t_wait
            self.timeline.add(Role.TRAINER, Stage.WAIT_GEN, step, t_wait, time.time())
            batch, m = ready.batch, ready.metrics
            m[Timing.WAIT_GEN] = wait
            async with self.sync.lock:  # from the update until its weights are exported
                update_end = await self.trainer.run(ready, step, m)
                self.version += 1
                self.live.note(Role.TRAINER, Stage.SYNC, step=step)
                export, loads = await self.sync.finish(self.version, update_end)
                self.timeline.add(Role.TRAINER, Stage.SYNC_EXPORT, step, export.start, export.end)
            validate = cfg.trainer.val_freq >= 0 and (
                step == N or (cfg.trainer.val_freq and step % cfg.trainer.val_freq == 0)
            )
            record = StepRecord(step, self.version, m, export.seconds, loads, bool(validate) and bool(self.inputs.val))
            if record.validate and not self.source.validate_after_loads:
                record.validation = self._start_validation()  # queued now, behind the load on every replica
            now = time.time()
            m[Timing.STEP], t_step = now - t_step, now
            m[Perf.TOKENS_PER_S] = float(batch.attention_mask.sum()) / m[Timing.STEP]
            m[Perf.SAMPLES_PER_S] = len(batch) / m[Timing.STEP]
            if self.fleet.lending is not None:
                m[Perf.LENT_CORES_S] = self.fleet.lending.take_seconds()
            m["policy_version"] = self.version
            save_freq, saves = cfg.trainer.save_freq, cfg.trainer.save_freq or cfg.trainer.save_last
            saving = (
                (save_freq and step % save_freq == 0)
                or (saves and (step == N or self.stop.requested))
                or (0 < cfg.trainer.save_interval_s <= now - saved_at)
            )  # so that a kill loses minutes, not the run
            if saving:
                self.source.hold()  # nothing admitted between this step's sync and its checkpoint
            finishing = asyncio.ensure_future(self._finish_step(record, finishing))
            if saving:
                await self._save_checkpoint(step, finishing)
                t_step = saved_at = time.time()  # a save is not part of the next step's time
            if self.stop.requested:
                self.console.log(
                    f"offstep: stopped after step {step}"
                    + ("" if saves else " (no checkpoint: trainer.save_freq=0 and trainer.save_last=false)")
                )
                break
        if finishing is not None:
            await finishing
        self.source.close()
        await self.live.stop()
        return self.history

    # ---------------------------------------------------------------- validation and records
    def _start_validation(self) -> asyncio.Future | None:
        if not self.inputs.val:
            return None
        return self.fleet.submit(self.inputs.val, self.val_params, self.cfg.trainer.seed + 1, 0, 10**9, with_ref=False)

    async def _finish_validation(self, fut, step: int = 0) -> dict:
        samples, _, _ = record_generation(self.timeline, await fut, step, stage=Stage.VAL)
        return {**summarise(samples), Val.POLICY_VERSION: samples[0].version}

    async def _finish_step(self, record: StepRecord, previous) -> None:
        """Complete a step's record once its weight sync (and validation) are done. Records are
        emitted in step order, since each waits for the previous step's first: a checkpoint relies
        on the metrics of the steps it covers being on disk."""
        if previous is not None:
            await previous
        m = record.metrics
        report: SyncReport = await record.loads  # raises if a replica does not hold what the trainer sent
        report.record(self.timeline, record.step, record.export_s, m)
        self.source.loaded(record.version)
        val = record.validation
        if record.validate and val is None:  # fully_async: a replica serves calls at once, the loads are checked
            val = self._start_validation()
        if val is not None:
            m.update(await self._finish_validation(val, record.step))
        self._emit(m)

    def _emit(self, m: dict) -> None:
        self.history.append(m)
        self.loggers.log(m)
        self.console.step(m)

    # ---------------------------------------------------------------- checkpoints
    async def _save_checkpoint(self, step: int, finishing) -> None:
        """Write the checkpoint of ``step``: trainer roles' shards, the prompt stream, and what the
        source has generating ahead, whose samples are awaited and stored so that a resumed run
        trains on exactly them (neither lost nor generated twice)."""
        t0 = time.time()
        self.console.status(f"step {step}: writing checkpoint")
        await finishing  # this step's metrics are on disk before the checkpoint that covers them
        self.checkpoints.phase("begin", step)
        in_flight = await self.source.freeze()
        staging = self.checkpoints.staging(step)
        self.checkpoints.phase("staged", step)  # on_phase: a kill test holds the write here
        await asyncio.gather(*(g.run(RoleWorker.save_checkpoint, str(staging / g.name)) for g in self.workers.stateful))
        self.checkpoints.phase("shards", step)
        state = TrainerState(
            step,
            self.version,
            self.timeline.t0,
            self.stream.state_dict(),
            in_flight,
            self.fleet.restarts,
            self.kl_ctrl.state_dict() if self.kl_ctrl is not None else None,
            self.source.stored_groups(),
        )
        # Its timeline entry goes in before the checkpoint is published: killed just after, a
        # resume from this checkpoint would never write it.
        path = self.checkpoints.commit(
            staging,
            state,
            to_yaml(self.cfg),
            lambda: self.timeline.add(Role.TRAINER, Stage.CHECKPOINT, step, t0, time.time()),
        )
        self.console.log(f"offstep: checkpoint {path} ({time.time() - t0:.1f} s)")
        self.source.thaw()

    def close(self, finished: bool = False) -> None:
        """``finished``: the run ended normally (passed on to ``Workers.close``)."""
        self.console.close()
        self.loggers.close()
        self.timeline.close()
        if self.workers is not None:
            self.workers.close(finished)
        self.lock.release()


def train(cfg: Config, start=None, on_phase: Callable[[str, int], None] | None = None) -> list[dict]:
    """Set up, run the loop, clean up; ``cfg`` is checked already (``offstep train`` checks it:
    ``offstep.launch.preflight.validate``). Returns the per-step metrics. ``start`` starts the
    workers (see :meth:`Controller.start`); ``on_phase`` sees each phase of a checkpoint write."""
    ctl = Controller(cfg, on_phase)
    finished = False
    try:
        ctl.start(start)
        history = asyncio.run(ctl.fit())
        finished = True
        return history
    except ray.exceptions.RayActorError as e:
        raise failure(e, complete_checkpoints(ctl.checkpoints.root)) from e
    finally:
        ctl.close(finished)
