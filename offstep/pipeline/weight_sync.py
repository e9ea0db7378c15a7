"""After every update, the actor's new weights reach every rollout replica, tagged with their
policy version: the controller's side of the weight sync.

Two transports (``pipeline.weight_sync``), both in ``offstep/sync/``: the object store (the actor
exports once, every replica reads the same copy) and a collective broadcast group (gloo or NCCL)
made once at start-up. The export of version v is queued behind the update that makes v on every
actor rank (:meth:`WeightSync.queue`), so no round trip separates the two; :meth:`finish` waits
for it and queues the loads, each behind its replica's generation in flight.

``lock`` is held by the loop from an update until its weights are exported, so a replica started
in between (a restart) loads exactly the trainer's current version (:meth:`reload`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from offstep.batch import Span
from offstep.config.schema import PipelineConfig
from offstep.pipeline.workers import Workers


@dataclass
class SyncCall:
    """A weight export in flight: the version, the actor ranks' calls, the rollout replicas'
    receives (collective path; ``None``: the loads follow the export)."""

    version: int
    export: list
    loads: list | None


class WeightSync:
    def __init__(self, cfg: PipelineConfig, workers: Workers):
        self.workers = workers
        self.lock = asyncio.Lock()
        self.version = 0  # the version the rollout replicas hold, or are loading
        self.queued: SyncCall | None = None
        # The replicas in the broadcast group. A replaced replica is not a member: from then on the
        # object store carries the weights.
        self.members: list | None = None
        if cfg.weight_sync == "collective":
            from offstep.sync.collective import connect

            connect(workers.actor.handles, workers.rollout, workers.sync_backend, cfg.weight_sync_bucket_mb,
                    cfg.weight_sync_timeout_s, max_in_flight=max(1, cfg.max_staleness), host=workers.host)
            self.members = list(workers.rollout)

    def _start(self, version: int) -> SyncCall:
        """Submit the export of the actor's weights as ``version`` (queued behind whatever the
        actor ranks are running) and, on the collective path, the receives on every replica."""
        w = self.workers
        if self.members is not None and w.rollout == self.members:
            # Receives first: each queues behind its replica's generation in flight. Actor rank 0
            # posts its broadcasts and returns (with NCCL it waits for every receiver).
            loads = [r.receive_weights.remote(version) for r in w.rollout]
            return SyncCall(version, w.actor.submit("send_weights", version), loads)
        return SyncCall(version, w.actor.submit("export_weights"), None)

    def queue(self, version: int) -> None:
        """Queue the export of ``version`` behind the actor update just submitted."""
        self.queued = self._start(version)

    async def finish(self, version: int, started: float | None) -> tuple[Span, asyncio.Future]:
        """Finish the export of ``version`` (queued behind its update, which ended at ``started``;
        or started now) and queue its load on every replica. Returns the export's span and the
        future of the replicas' load spans."""
        call, self.queued = self.queued, None
        if call is None:  # no update queued one (the actor is frozen during the critic's warm-up)
            call, started = self._start(version), time.time()
        assert call.version == version, f"the queued export is of version {call.version}, not {version}"
        exported = (await asyncio.gather(*call.export))[0]
        loads = call.loads
        if loads is None:  # object store: every replica reads the same copy
            loads = [r.load_weights.remote(exported[0], version) for r in self.workers.rollout]
        self.version = version
        return Span(started, time.time(), version), asyncio.ensure_future(asyncio.gather(*loads))

    async def reload(self, replica: int) -> None:
        """Give a freshly started replica the current weights (between updates)."""
        async with self.lock:
            exported = await self.workers.actor.run("export_weights")
            await self.workers.rollout[replica].load_weights.remote(exported[0], self.version)

