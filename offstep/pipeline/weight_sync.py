"""After every update, the actor's new weights reach every rollout replica, tagged with their
policy version: the controller's side of the weight sync.

Two transports (``pipeline.weight_sync``), both in ``offstep/sync/``: the object store (the actor
exports once, every replica reads the same copy) and a collective broadcast group (gloo or NCCL)
made at start-up. The export of version v is queued behind the update that makes v on every
actor rank (:meth:`WeightSync.queue`), so no round trip separates the two; :meth:`finish` waits
for it and queues the loads, each behind its replica's generation in flight.

With ``pipeline.weight_sync_delta`` a sync carries only what changed since the version before
(``offstep.sync.delta``); a replica that refuses one (it holds another version) gets the current
weights whole (:meth:`_rebase`), and every ``weight_sync_full_every``-th sync is full.

Every sync proves it arrived (``offstep.sync.digest``): the actor returns the digest of what it
sent, every replica the digest of what its engine holds after the load, and :meth:`_check`
compares them, in step order, as the loads end. A mismatch, or a replica whose weights did not
change while the trainer's did, stops the run naming the replica and the version.

A replaced replica (``offstep.pipeline.fleet``) gets the current weights in :meth:`reload`; on
the collective path every replica first joins a new broadcast group with it (:meth:`_rebuild`),
so the next sync is a broadcast again.

``lock`` is held by the loop from an update until its weights are exported, so a replica started
in between (a restart) loads exactly the trainer's current version (:meth:`reload`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import ray

from offstep.batch import Span
from offstep.config.schema import PipelineConfig
from offstep.pipeline.workers import Workers
from offstep.sync.digest import Loaded, WeightDigest, check_load
from offstep.telemetry.metrics import Timeline
from offstep.telemetry.names import Stage, Sync, Timing, replica
from offstep.train.actor import ActorWorker


@dataclass
class SyncCall:
    """A weight export in flight: the version, the actor ranks' calls, the rollout replicas'
    receives (collective path; ``None``: the loads follow the export)."""

    version: int
    export: list
    loads: list | None


@dataclass(frozen=True)
class SyncReport:
    """A sync as the rollout side took it: each replica's load report (``None``: the replica died
    before it loaded; its replacement is checked in :meth:`WeightSync.reload`), whether every
    replica's digest matched, and whether the sync went over the collective group."""

    loads: list[Loaded | None]
    verified: bool
    collective: bool

    @property
    def verify_s(self) -> float:
        """The slowest replica's digest: what verifying adds to a load."""
        return max((r.digest_s for r in self.loads if r is not None), default=0.0)

    @property
    def wake_s(self) -> float | None:
        """The slowest replica's wakes, before and around its load (``rollout.sleep_during_update``);
        ``None`` when no replica was asleep."""
        woke = [sum(w.seconds for w in r.woke) for r in self.loads if r is not None and r.woke]
        return max(woke) if woke else None

    def record(self, timeline: Timeline, step: int, export_s: float, m: dict) -> None:
        """The replicas' loads (and a sleeping replica's wakes) on the timeline; the sync's
        metrics into ``m`` (``export_s``: the trainer's export before the loads)."""
        transport = "collective" if self.collective else "object_store"
        for i, r in enumerate(self.loads):
            if r is None:
                continue
            span = r.span
            timeline.add(
                replica(i), Stage.LOAD_WEIGHTS, step, span.start, span.end, version=span.version, transport=transport
            )
            for wake in r.woke:  # rollout.sleep_during_update
                timeline.add(replica(i), Stage.WAKE, step, wake.start, wake.end)
        m[Timing.SYNC_WEIGHTS] = export_s + max((r.span.seconds for r in self.loads if r is not None), default=0.0)
        m[Sync.VERIFIED] = float(self.verified)
        m[Timing.SYNC_VERIFY] = self.verify_s  # wall clock: with the other timings, not compared on resume
        m[Sync.COLLECTIVE] = float(self.collective)
        if self.wake_s is not None:  # the replicas slept during the update
            m[Timing.ROLLOUT_WAKE] = self.wake_s


class WeightSync:
    def __init__(self, cfg: PipelineConfig, workers: Workers):
        self.cfg, self.workers = cfg, workers
        self.lock = asyncio.Lock()
        self.version = 0  # the version the rollout replicas hold, or are loading
        self.queued: SyncCall | None = None
        # What every digest covers: the rollout side's manifest, given to the actor once.
        self.specs = ray.get(workers.rollout[0].weight_sync_manifest.remote())
        full_every = cfg.weight_sync_full_every if cfg.weight_sync_delta else 0  # 0: every sync full
        ray.get(workers.actor.submit(ActorWorker.set_sync_manifest, self.specs, full_every))
        self.rebased = 0  # replicas that refused a delta and got a full sync instead
        self.sent: WeightDigest | None = None  # the digest of the last version sent
        self.held: list[WeightDigest | None] = [None] * len(workers.rollout)  # each replica's last load
        self._checked: asyncio.Future | None = None  # the last sync's check (they run in step order)
        # The replicas in the broadcast group (None: the object store carries every sync).
        self.members: list | None = None
        if cfg.weight_sync == "collective":
            from offstep.sync.collective import connect

            connect(
                workers.actor.handles,
                workers.rollout,
                workers.sync_backend,
                cfg.weight_sync_bucket_mb,
                cfg.weight_sync_timeout_s,
                max_in_flight=self._in_flight,
                host=workers.host,
                specs=self.specs,
                in_place=self._in_place,
            )
            self.members = list(workers.rollout)

    @property
    def _in_place(self) -> bool:
        """Whether a replica may receive straight into the weights it generates with: not while it
        generates (pipeline.mode=fully_async), where a receive lands beside the decode steps."""
        return self.cfg.mode != "fully_async"

    @property
    def _in_flight(self) -> int:
        return max(1, self.cfg.max_staleness)

    def _start(self, version: int) -> SyncCall:
        """Submit the export of the actor's weights as ``version`` (queued behind whatever the
        actor ranks are running) and, on the collective path, the receives on every replica."""
        w = self.workers
        if self.members is not None and w.rollout == self.members:
            # Receives first: each queues behind its replica's generation in flight. Actor rank 0
            # posts its broadcasts and returns (with NCCL it waits for every receiver).
            loads = [r.receive_weights.remote(version) for r in w.rollout]
            return SyncCall(version, w.actor.submit(ActorWorker.send_weights, version), loads)
        return SyncCall(version, w.actor.submit(ActorWorker.export_weights), None)

    def queue(self, version: int) -> None:
        """Queue the export of ``version`` behind the actor update just submitted."""
        self.queued = self._start(version)

    async def finish(self, version: int, started: float | None) -> tuple[Span, asyncio.Future]:
        """Finish the export of ``version`` (queued behind its update, which ended at ``started``;
        or started now) and queue its load on every replica. Returns the export's span and the
        future of its :class:`SyncReport` (which raises if a replica does not hold what was sent)."""
        call, self.queued = self.queued, None
        if call is None:  # no update queued one (the actor is frozen during the critic's warm-up)
            call, started = self._start(version), time.time()
        assert call.version == version, f"the queued export is of version {call.version}, not {version}"
        exported = (await asyncio.gather(*call.export))[0]
        loads = call.loads
        if loads is None:  # object store: every replica reads the same copy
            ref, sent = exported
            loads = [r.load_weights.remote(ref, version) for r in self.workers.rollout]
        else:
            sent = exported
        self.version = version
        previous, self.sent = self.sent, sent
        self._checked = asyncio.ensure_future(
            self._check(version, sent, previous, loads, call.loads is not None, self._checked)
        )
        return Span(started, time.time(), version), self._checked

    async def _check(
        self,
        version: int,
        sent: WeightDigest,
        previous: WeightDigest | None,
        loads: list,
        collective: bool,
        before: asyncio.Future | None,
    ) -> SyncReport:
        """Wait for every replica's load of ``version`` and compare its digest with ``sent``
        (after the previous version's check: each replica's last digest is the reference for
        "its weights did not change")."""
        if before is not None:
            await asyncio.wait([before])  # its failure is raised where it is awaited
        results = await asyncio.gather(*loads, return_exceptions=True)
        reports: list[Loaded | None] = []
        for i, r in enumerate(results):
            if isinstance(r, ray.exceptions.RayActorError):  # replaced, with the current weights, when next used
                reports.append(None)
                continue
            if isinstance(r, BaseException):
                raise r
            if r.refused:  # a delta that did not fit what the replica holds (which stays): a full sync
                reports.append(await self._rebase(i))
                continue
            check_load(i, version, sent, r.digest, previous, self.held[i])
            self.held[i] = r.digest
            reports.append(r)
        return SyncReport(reports, all(r is not None for r in reports), collective)

    async def _rebase(self, replica: int) -> Loaded:
        """The trainer's current weights, whole, to a replica that refused a delta (checked like a
        sync); the next delta is made from them."""
        async with self.lock:
            ref, sent = await self.workers.actor.run(ActorWorker.export_weights, True)
            loaded: Loaded = await self.workers.rollout[replica].load_weights.remote(ref, self.version)
            check_load(replica, self.version, sent, loaded.digest, None, None)
            self.held[replica] = loaded.digest
            self.rebased += 1
            return loaded

    async def reload(self, replica: int) -> None:
        """Give a freshly started replica the current weights (between updates), checked like a
        sync; on the collective path, first rebuild the group with it."""
        async with self.lock:
            if self.members is not None:
                await self._rebuild()
            ref, sent = await self.workers.actor.run(ActorWorker.export_weights, True)  # full, never a delta
            loaded: Loaded = await self.workers.rollout[replica].load_weights.remote(ref, self.version)
            check_load(replica, self.version, sent, loaded.digest, None, None)
            self.held[replica] = loaded.digest

    async def _rebuild(self) -> None:
        """A new broadcast group of actor rank 0 and every replica (a new store, on a new port).
        A live replica joins once the calls queued before (its generation, its receive from the
        old group) are done; the actor's join waits for all of them."""
        from offstep.sync.collective import join

        w, cfg = self.workers, self.cfg
        self.members = None  # until every member has joined
        endpoint = await w.actor.handles[0].open_weight_sync.remote(cfg.weight_sync_timeout_s, w.host)
        await asyncio.gather(
            *join(
                w.actor.handles,
                w.rollout,
                endpoint,
                w.sync_backend,
                self.specs,
                cfg.weight_sync_bucket_mb,
                cfg.weight_sync_timeout_s,
                self._in_flight,
                self._in_place,
            )
        )
        self.members = list(w.rollout)
