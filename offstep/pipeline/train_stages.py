"""The trainer's stages on one prepared batch, in order: the passes the advantages need (reference,
critic values, pre-update log-probs), the advantages, the critic's update, the actor's update.
Each stage runs on every rank of its role group and is put on the timeline; the actor's update is
submitted before the weight export is queued behind it (``WeightSync.queue``), so no round trip
separates the two."""

from __future__ import annotations

import asyncio

import ray

from offstep.batch import Span, TrainBatch
from offstep.config.schema import Config
from offstep.pipeline.compute_advantages import needs_old_logprobs
from offstep.pipeline.pools import RoleGroup
from offstep.pipeline.prepare import Prepared
from offstep.telemetry.names import Actor, Role, Stage, Timing, actor, critic
from offstep.train.actor import ActorWorker
from offstep.train.critic import CriticWorker


class TrainerStages:
    def __init__(self, cfg: Config, workers, fleet, sync, preparer, timeline):
        self.cfg, self.workers, self.fleet, self.sync = cfg, workers, fleet, sync
        self.preparer, self.timeline = preparer, timeline

    async def run(self, ready: Prepared, step: int, m: dict) -> float | None:
        """Train on ``ready``; returns when the actor's update ended (``None``: the actor did not
        update), which is when the export of its weights, queued behind it, began."""
        cfg, w = self.cfg, self.workers
        if w.sleeps:  # colocated: the replicas free the devices until the load (rollout.sleep_during_update)
            m[Timing.ROLLOUT_SLEEP] = await self.fleet.sleep(step, self.timeline)
        # Critic warm-up: only the critic trains during the first critic.warmup_steps steps.
        actor_frozen = w.critic is not None and step <= cfg.critic.warmup_steps
        stored = ready.stored if ready.stored is not None else await self._inputs(ready.batch, step, m, actor_frozen)
        if w.critic is not None:
            cm, span = await self.stage(w.critic, CriticWorker.update, Stage.UPDATE_CRITIC, step, stored)
            m[Timing.UPDATE_CRITIC] = span.seconds
            m.update({critic(k): v for k, v in cm.items()})
            m[Actor.FROZEN] = float(actor_frozen)
        if actor_frozen:
            return None
        update = w.actor.submit(ActorWorker.update, stored)
        self.sync.queue(step)  # the update makes version `step`; its export starts as the update ends
        am, span = await self.stage(w.actor, update, Stage.UPDATE_ACTOR, step)
        m[Timing.UPDATE_ACTOR] = span.seconds
        m.update({actor(k): v for k, v in am.items()})
        return span.end

    async def _inputs(self, batch: TrainBatch, step: int, m: dict, actor_frozen: bool) -> ray.ObjectRef:
        """The passes over the batch that the advantages need from the trainer workers, then the
        advantages; returns the batch's object-store ref."""
        w = self.workers
        if w.ref is not None:
            batch.ref_logprobs, span = await self.stage(w.ref, ActorWorker.compute_ref_logprobs, Stage.REF, step, batch)
            m[Timing.REF] = span.seconds
        if w.critic is not None:
            batch.values, span = await self.stage(w.critic, CriticWorker.compute_values, Stage.VALUES, step, batch)
            m[Timing.VALUES] = span.seconds
        if needs_old_logprobs(self.cfg, len(batch), actor_frozen):
            batch.old_logprobs, span = await self.stage(
                w.actor, ActorWorker.compute_logprobs, Stage.OLD_LOGPROBS, step, batch
            )
            m[Timing.OLD_LOGPROBS] = span.seconds
        return self.preparer.advantages_and_put(batch, m)

    async def stage(self, group: RoleGroup, call, stage: str, step: int, *args) -> tuple[object, Span]:
        """Run a method on every rank of ``group`` (``call``: the worker class's method, or the
        calls already submitted); rank 0's result and :class:`Span` (also put on the timeline)."""
        self.workers.live.note(Role.TRAINER, stage, step=step)
        refs = call if isinstance(call, list) else group.submit(call, *args)
        result, span = (await asyncio.gather(*refs))[0]
        self.timeline.add(Role.TRAINER, stage, step, span.start, span.end)
        return result, span
