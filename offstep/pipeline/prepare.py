"""From a generated batch to one the trainer can take, in the driver, as soon as its samples
arrive (for k >= 1 usually while the trainer still updates on the batch before): the rollout
side's timeline entries, the sample log, collate, the staleness check, the batch's metrics and,
when the advantages need nothing from the trainer, the advantages and the object-store copy.

``check_staleness`` is the one place the bound ``trainer_version - sample.version <= k`` is
enforced: batch b is trained at step b by the policy of version b - 1 (one update per step), so
its staleness is known here already.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass

import ray
import torch

from offstep.batch import TrainBatch, collate
from offstep.config.schema import Config
from offstep.errors import StalenessError
from offstep.models.vision import load_image_processor, pixel_inputs
from offstep.pipeline.compute_advantages import compute_advantages, needs_old_logprobs
from offstep.pipeline.dynamic_sampling import Generated
from offstep.pipeline.inputs import Inputs
from offstep.pipeline.step_metrics import (
    batch_metrics,
    dropped_metrics,
    record_generation,
    reward_model_seconds,
    sample_rows,
    sandbox_metrics,
)
from offstep.telemetry.loggers import RunLoggers
from offstep.telemetry.metrics import Timeline
from offstep.telemetry.names import Data, Perf, Role, Rollout, Stage, Timing


def check_staleness(versions: torch.Tensor, trainer_version: int, max_staleness: int) -> torch.Tensor:
    """The one place the staleness bound is checked. Returns per-sample staleness."""
    staleness = trainer_version - versions
    if staleness.numel() and (int(staleness.max()) > max_staleness or int(staleness.min()) < 0):
        raise StalenessError(
            f"batch staleness {staleness.min().item()}..{staleness.max().item()} at trainer version "
            f"{trainer_version} breaks pipeline.max_staleness={max_staleness}"
        )
    return staleness


@dataclass
class Prepared:
    """A generated batch made ready for the trainer: collated, its metrics taken and, when they
    need nothing from the trainer, its advantages computed and the batch put in the object store
    (``stored``)."""

    batch: TrainBatch
    metrics: dict
    stored: ray.ObjectRef | None = None


class BatchPreparer:
    def __init__(self, cfg: Config, inputs: Inputs, timeline: Timeline, loggers: RunLoggers, kl_ctrl):
        self.cfg, self.inputs, self.timeline, self.loggers, self.kl_ctrl = cfg, inputs, timeline, loggers, kl_ctrl
        self._image_processor = None  # a VL model's, loaded at the first batch with images

    def prepare(self, gen: Generated, step: int, epoch: int, idx: list[int], trainer_first: bool) -> Prepared:
        """Batch ``step`` (prompts ``idx`` of ``epoch``). ``trainer_first``: the advantages need a
        pass on the trainer pool first (reference or critic there), so they are left to the loop."""
        t0 = time.time()
        gen_s = ref_s = 0.0
        for attempt, results in enumerate(gen.rounds):
            _, g, r = record_generation(self.timeline, results, step, Stage.GEN if attempt == 0 else Stage.GEN_MORE)
            gen_s, ref_s = gen_s + g, ref_s + r
        self._log_samples(step, gen)
        batch = collate(gen.samples, self.inputs.pad_id)
        batch.images = self._images(gen)
        # Per sample: the actor reports its correction metrics per staleness.
        batch.staleness = check_staleness(batch.versions, step - 1, self.cfg.pipeline.max_staleness)
        m = batch_metrics(step, epoch, gen.samples, batch, batch.staleness)
        m.update(sandbox_metrics([r for results in gen.rounds for r in results]))
        m.update(dropped_metrics(gen.dropped, m))
        m[Data.PROMPTS_CRC32] = zlib.crc32(",".join(map(str, idx)).encode())
        if self.cfg.rollout.over_sample_rate > 0:
            m[Rollout.OVER_SAMPLE_CUT] = sum(t.cut for results in gen.rounds for _, t in results)
        if self.cfg.algorithm.dynamic_sampling:
            m[Rollout.DYNAMIC_SAMPLING_ATTEMPTS] = len(gen.rounds)
            m[Rollout.DYNAMIC_SAMPLING_FILLED_GROUPS] = gen.filled_groups
        if gen.rounds:  # the fully asynchronous mode's stream gives its own (offstep.pipeline.sample_stream)
            m[Timing.GEN] = gen_s
            m[Perf.GEN_TOKENS_PER_S] = float(batch.response_mask.sum()) / max(gen_s, 1e-9)
        if ref_s:
            m[Timing.REF_ROLLOUT] = ref_s
        for key, field in ((Timing.REWARD_MODEL, "reward"), (Timing.TEACHER, "teacher")):
            scored = [s for s in (reward_model_seconds(r, field) for r in gen.rounds) if s is not None]
            if scored:
                m[key] = sum(scored)
        ready = Prepared(batch, m)
        if not trainer_first and not needs_old_logprobs(self.cfg, len(batch)):
            ready.stored = self.advantages_and_put(batch, m)  # nothing needed from the trainer
        self.timeline.add(Role.DRIVER, Stage.PREPARE, step, t0, time.time())
        return ready

    def _images(self, gen: Generated) -> dict | None:
        """A VL model's images of the batch's prompts, by uid (``TrainBatch.images``), or None."""
        train = self.inputs.train
        if not any(train[i].images for i in gen.prompt_of.values()):
            return None
        if self._image_processor is None:
            self._image_processor = load_image_processor(self.inputs.model_path)
        return {uid: pixel_inputs(self._image_processor, train[i].images) for uid, i in gen.prompt_of.items()}

    def advantages_and_put(self, batch: TrainBatch, m: dict) -> ray.ObjectRef:
        algo = self.cfg.algorithm
        if algo.correction_mode == "bypass":  # the rollout's log-probs are the old policy: no forward pass
            batch.old_logprobs = batch.rollout_logprobs
        t0 = time.time()
        m.update(compute_advantages(batch, algo, self.kl_ctrl, self.cfg.rollout.max_new_tokens, self.cfg.distill))
        m[Timing.ADV] = time.time() - t0
        return ray.put(batch)  # one copy in the object store, read by every rank

    def _log_samples(self, step: int, gen: Generated) -> None:
        t = self.cfg.trainer
        if t.log_samples_freq and (step == 1 or step % t.log_samples_freq == 0):
            text = {uid: self.inputs.train[i].record.messages[-1]["content"] for uid, i in gen.prompt_of.items()}
            self.loggers.log_samples(step, sample_rows(step, gen.samples, text, t.log_samples_count))
