"""Where a step's batch comes from: one interface that both pipeline modes fill, so that the
controller's loop reads the same in both (``controller.py``).

* :class:`AheadBatches` (``pipeline.mode=batch``): up to ``k`` whole batches generating ahead of
  the one a step consumes, each prepared (collated, measured, advantages where the trainer adds
  nothing) as soon as its samples arrive.
* :class:`StreamBatches` (``pipeline.mode=fully_async``): the step's groups taken from the sample
  stream as they finish (``sample_stream.py``), prepared the same way.

A source is started once (from a checkpoint's state when resuming), asked for each step's
:class:`Prepared` batch, told when every replica holds a new version, and frozen around a
checkpoint: what it has generating ahead is stored with the checkpoint and continues after it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from offstep.config.schema import Config
from offstep.errors import ConfigError
from offstep.pipeline.dynamic_sampling import generate_batch
from offstep.pipeline.prepare import BatchPreparer, Prepared
from offstep.pipeline.sample_stream import SampleStream
from offstep.pipeline.trainer_state import TrainerState
from offstep.rollout.types import SamplingParams
from offstep.telemetry.names import Perf, Timing


@dataclass
class InFlight:
    """A batch whose generation has been launched: its position in the stream, the future of its
    :class:`Generated` samples, and the future of its :class:`Prepared` batch."""

    batch_idx: int
    epoch: int
    idx: list[int]  # prompt indices into the training set
    generated: asyncio.Future
    prepared: asyncio.Future | None = None


def _done(result) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(result)
    return fut


class AheadBatches:
    """Batch mode: keeps ``k`` batches generating ahead of the one the step consumes."""

    validate_after_loads = False  # a validation is queued at once, behind the load on every replica

    def __init__(self, cfg: Config, inputs, prompts, fleet, params, preparer: BatchPreparer, trainer_first: bool):
        self.cfg, self.inputs, self.prompts, self.fleet, self.params = cfg, inputs, prompts, fleet, params
        self.preparer, self.trainer_first = preparer, trainer_first
        self.k, self.N = cfg.pipeline.max_staleness, cfg.trainer.total_steps
        self.pending: deque[InFlight] = deque()
        self.launched = 0

    async def start(self, version: int, start_step: int, resumed: TrainerState | None) -> None:
        # Batches already launched when the checkpoint was written come back as they were.
        restored = resumed.in_flight if resumed is not None else []
        self.pending = deque(self._in_flight(b, e, idx, _done(gen)) for b, e, idx, gen in restored)
        self.launched = start_step + len(self.pending)

    def next(self, step: int) -> asyncio.Future:
        while len(self.pending) <= self.k and self.launched < self.N:
            self.launched += 1
            self.pending.append(self._launch(self.launched))
        cur = self.pending.popleft()
        assert cur.batch_idx == step
        return cur.prepared

    def _launch(self, batch_idx: int) -> InFlight:
        epoch, idx = self.prompts.next_batch()
        return self._in_flight(
            batch_idx,
            epoch,
            idx,
            generate_batch(  # submitted to the replicas now
                self.fleet.submit,
                self.inputs.train,
                self.params,
                self.cfg.algorithm,
                self.cfg.trainer.seed,
                batch_idx,
                idx,
            ),
        )

    def _in_flight(self, batch_idx: int, epoch: int, idx: list[int], generated: asyncio.Future) -> InFlight:
        cur = InFlight(batch_idx, epoch, idx, generated)
        cur.prepared = asyncio.ensure_future(self._prepare(cur))
        return cur

    async def _prepare(self, cur: InFlight) -> Prepared:
        """The driver's work on a batch as soon as its samples arrive (``prepare.py``); for k >= 1
        usually while the trainer still updates on the batch before."""
        return self.preparer.prepare(await cur.generated, cur.batch_idx, cur.epoch, cur.idx, self.trainer_first)

    def loaded(self, version: int) -> None:
        pass

    def hold(self) -> None:
        pass

    async def freeze(self) -> list:
        """The batches generating ahead, awaited: a checkpoint stores their samples."""
        return [(b.batch_idx, b.epoch, b.idx, await b.generated) for b in self.pending]

    def stored_groups(self) -> dict | None:
        return None

    def thaw(self) -> None:
        pass

    def close(self) -> None:
        pass


class StreamBatches:
    """fully_async: the step's groups from the sample stream, prepared as a batch mode's batch is."""

    validate_after_loads = True  # a replica serves calls at once: validate once the loads are checked

    def __init__(self, samples: SampleStream, preparer: BatchPreparer, trainer_first: bool, batch_size: int):
        self.samples, self.preparer, self.trainer_first, self.B = samples, preparer, trainer_first, batch_size

    async def start(self, version: int, start_step: int, resumed: TrainerState | None) -> None:
        saved = resumed.stream_groups if resumed is not None else None
        await self.samples.start(version, start_step * self.B, saved)

    def next(self, step: int) -> asyncio.Future:
        return asyncio.ensure_future(self._take(step))

    async def _take(self, step: int) -> Prepared:
        gen, epoch, idx, m = await self.samples.next_batch(step)
        ready = self.preparer.prepare(gen, step, epoch, idx, self.trainer_first)
        ready.metrics.update(m)
        ready.metrics[Perf.GEN_TOKENS_PER_S] = float(ready.batch.response_mask.sum()) / max(m[Timing.GEN], 1e-9)
        return ready

    def loaded(self, version: int) -> None:
        self.samples.loaded(version)  # every replica holds the new version: the stream may admit more

    def hold(self) -> None:
        self.samples.hold()  # nothing admitted between this step's sync and its checkpoint

    async def freeze(self) -> list:
        await self.samples.suspend()  # every in-flight sample stops where it is, to be stored
        return []

    def stored_groups(self) -> dict | None:
        return self.samples.state()

    def thaw(self) -> None:
        self.samples.resubmit()  # the stored samples continue where they stopped
        self.samples.release()

    def close(self) -> None:
        self.samples.close()


async def unless_failed(fut: asyncio.Future, finishing: asyncio.Future | None):
    """``await fut`` (a step's batch), unless the records being finished fail first (a weight sync
    that did not arrive): then that error, at once, rather than when the records are next awaited."""
    if finishing is not None:
        await asyncio.wait([fut, finishing], return_when=asyncio.FIRST_COMPLETED)
        if finishing.done() and finishing.exception() is not None:
            raise finishing.exception()
    return await fut


def check_mode_of(state: TrainerState, cfg: Config, path) -> None:
    """A checkpoint that holds samples generated ahead resumes in the mode that stored them: the
    other mode would not train them, and their prompts would be skipped."""
    stream = state.stream_groups is not None and bool(state.stream_groups.get("groups"))
    stored = "fully_async" if stream else "batch" if state.in_flight else None
    if stored is not None and stored != cfg.pipeline.mode:
        raise ConfigError(
            f"{path} holds samples generated ahead in pipeline.mode={stored}, which "
            f"pipeline.mode={cfg.pipeline.mode} would not train (their prompts would be skipped); "
            f"resume with pipeline.mode={stored}; a checkpoint written with pipeline.max_staleness=0 "
            f"holds none and resumes in either mode"
        )


def sampling_params(cfg: Config) -> tuple[SamplingParams, SamplingParams]:
    """How training batches and validations are sampled."""
    ro = cfg.rollout
    train = SamplingParams(
        n=ro.n,
        temperature=ro.temperature,
        top_p=ro.top_p,
        top_k=ro.top_k,
        max_new_tokens=ro.max_new_tokens,
        stop=tuple(ro.stop),
        greedy_baseline=cfg.algorithm.adv_estimator == "remax",
        over_sample_rate=ro.over_sample_rate,  # training batches only: a validation scores every prompt
    )
    val = SamplingParams(
        n=ro.val_n,
        temperature=ro.val_temperature,
        top_p=ro.val_top_p,
        top_k=ro.val_top_k,
        max_new_tokens=ro.max_new_tokens,
        stop=tuple(ro.stop),
    )
    return train, val


BatchSource = AheadBatches | StreamBatches  # what fills the loop's batches, in either mode


def make_source(cfg: Config, inputs, prompts, workers, fleet, params, timeline, preparer) -> BatchSource:
    """The source of ``pipeline.mode``."""
    trainer_first = workers.ref is not None or workers.critic is not None  # passes the advantages need
    if cfg.pipeline.mode == "fully_async":
        samples = SampleStream(cfg, inputs, prompts, workers, params, timeline, fleet.restart)
        return StreamBatches(samples, preparer, trainer_first, cfg.data.train_batch_size)
    return AheadBatches(cfg, inputs, prompts, fleet, params, preparer, trainer_first)
