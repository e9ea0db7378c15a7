"""The rollout replicas as one fleet: a generation call is split across them in contiguous
shares, each share with its own seed, and a replica that dies, or does not answer within
``rollout.timeout_s``, is replaced and its share generated again with the same seed. Colocated
replicas sleep while the trainer updates (:meth:`RolloutFleet.sleep`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import ray

from offstep.config.schema import RolloutConfig
from offstep.errors import RolloutFailed
from offstep.pipeline.inputs import to_request
from offstep.pipeline.lending import CoreLending
from offstep.pipeline.workers import Workers, node_of
from offstep.telemetry.metrics import Timeline
from offstep.telemetry.names import Stage, replica


def gen_seed(seed: int, batch: int, replica: int) -> int:
    return (seed * 1_000_003 + batch * 7919 + replica) % (2**63 - 1)


def split(items: list, parts: int) -> list[list]:
    """Contiguous, near-equal chunks (replica i answers chunk i)."""
    q, r = divmod(len(items), parts)
    out, i = [], 0
    for p in range(parts):
        n = q + (1 if p < r else 0)
        out.append(items[i : i + n])
        i += n
    return out


async def _await(object_ref):
    return await object_ref


class RolloutFleet:
    def __init__(
        self,
        workers: Workers,
        cfg: RolloutConfig,
        reload: Callable[[int], Awaitable[None]],
        log: Callable[[str], None],
        restarts: int = 0,
        lending: CoreLending | None = None,
    ):
        self.workers, self.cfg, self.reload, self.log = workers, cfg, reload, log
        self.lending = lending  # told when generation starts and ends (pipeline.lend_cores)
        self.restarts = restarts  # replicas replaced so far in this run (a checkpoint carries it)
        self._replacing: dict[int, asyncio.Lock] = {}  # one replacement of a replica at a time
        self._failed: dict[int, Exception] = {}  # replica -> why its replacement could not be made

    def submit(
        self, prompts, params, seed_base: int, batch_idx: int, uid0: int, with_ref: bool = True
    ) -> asyncio.Future:
        """Generate ``params.n`` samples of each prompt; the future gives one ``(samples,
        GenTiming)`` per replica that had a share, in replica order.

        The replicas' calls are submitted before this returns, not when the event loop next runs
        the future: a replica runs its calls in submission order, so a weight load (or a receive
        on the collective path) submitted after this call is ordered after this generation."""
        requests = [to_request(p, uid0 + i) for i, p in enumerate(prompts)]
        if self.lending is not None:  # the trainer gives the rollout's cores back before it starts
            self.lending.busy()
        shares = []
        for i, share in enumerate(split(requests, len(self.workers.rollout))):
            if share:
                args = (share, params, gen_seed(seed_base, batch_idx, i), with_ref)
                worker = self.workers.rollout[i]
                shares.append(self._generate_on(i, args, worker, worker.generate.remote(*args)))
        generated = asyncio.ensure_future(asyncio.gather(*shares))
        if self.lending is not None:
            generated.add_done_callback(self.lending.idle)
        return generated

    async def sleep(self, step: int, timeline: Timeline) -> float:
        """Every replica frees its device memory for the trainer (``rollout.sleep_during_update``;
        the weight load after the update wakes it): each sleep goes on its replica's lane, and the
        slowest one's seconds are returned. A replica that died is passed over: its replacement
        starts awake."""
        slept = []
        for i, span in enumerate(
            await asyncio.gather(*(r.sleep.remote() for r in self.workers.rollout), return_exceptions=True)
        ):
            if span is None or isinstance(span, ray.exceptions.RayActorError):  # asleep already; died
                continue
            if isinstance(span, BaseException):
                raise span
            timeline.add(replica(i), Stage.SLEEP, step, span.start, span.end)
            slept.append(span.seconds)
        return max(slept, default=0.0)

    async def _generate_on(self, i: int, args: tuple, worker, call):
        """``call``, submitted to ``worker`` (replica i); on the replacement when the worker dies or hangs."""
        while True:
            try:
                return await asyncio.wait_for(_await(call), self.cfg.timeout_s)
            except asyncio.TimeoutError:
                await self.restart(
                    i, worker, f"did not finish a generation within rollout.timeout_s={self.cfg.timeout_s:g}"
                )
            except ray.exceptions.RayActorError as e:
                await self.restart(i, worker, f"died ({type(e).__name__})")
            worker = self.workers.rollout[i]
            call = worker.generate.remote(*args)  # the same requests and seed, on the new replica

    async def restart(self, i: int, failed, why: str) -> None:
        """Replace replica i, whose worker ``failed``, unless that worker was replaced already: the
        calls queued on one worker fail together (its node left the cluster, say; with k >= 1 two
        generations can be queued), and one replacement serves them all. When it could not be
        made, every one of those calls fails with its error: the call that made it may be for a
        later batch than the one the trainer waits for, which would otherwise be sent to a
        replacement that never starts, and wait for it forever. For the same reason the
        replacement is killed: a weight load sent to it meanwhile fails instead of waiting. The
        fully asynchronous stream (``offstep.pipeline.sample_stream``) replaces its replicas here too."""
        async with self._replacing.setdefault(i, asyncio.Lock()):
            if i in self._failed:
                raise self._failed[i]
            if self.workers.rollout[i] is failed:
                try:
                    await self._replace(i, why)
                except Exception as e:
                    self._failed[i] = e
                    ray.kill(self.workers.rollout[i], no_restart=True)
                    raise

    async def _replace(self, i: int, why: str) -> None:
        if self.restarts >= self.cfg.max_restarts:
            raise RolloutFailed(
                f"rollout worker {i} {why}, and rollout.max_restarts={self.cfg.max_restarts} restarts are used up; "
                f"see the worker's log above (Ray prints it). Raise rollout.max_restarts or rollout.timeout_s, "
                f"and resume from the last checkpoint with trainer.resume=auto"
            )
        self.restarts += 1
        self.log(f"offstep: rollout worker {i} {why}; starting a new one ({self.restarts}/{self.cfg.max_restarts})")
        ray.kill(self.workers.rollout[i], no_restart=True)
        self.workers.rollout[i] = self.workers.make_rollout(i)
        await self._started(i, why)
        await self.reload(i)

    async def _started(self, i: int, why: str) -> None:
        """Wait until replica i's replacement is up. Its bundle may still be booked on the node that
        just left (Ray declares a node dead only after missed heartbeats): a replacement that dies
        with that node before it ran is started again. One whose bundle no node can hold stops the
        run after the placement wait instead of waiting for a node forever."""
        t0, wait_s = time.monotonic(), self.workers.placement_wait_s()
        while True:
            new = self.workers.rollout[i]
            ready = asyncio.ensure_future(_await(new.__ray_ready__.remote()))
            while not ready.done():
                if time.monotonic() - t0 > wait_s and not self.workers.rollout_placed(i):
                    ready.cancel()
                    raise RolloutFailed(
                        f"rollout worker {i} {why}, and no node of the Ray cluster had room for its replacement within "
                        f"{wait_s:g} s (resources.placement_timeout_s; its node left the cluster; only a node with the "
                        f"rollout pool's resources, rollout.cpus_per_replica, gpus_per_replica and "
                        f"custom_resources_per_replica, can take it). Add such a node, and resume from the last "
                        f"checkpoint with trainer.resume=auto"
                    )
                await asyncio.wait([ready], timeout=1.0)
            try:
                ready.result()
                break
            except ray.exceptions.RayActorError as e:
                if getattr(e, "actor_init_failed", False) or time.monotonic() - t0 > wait_s:
                    raise  # its constructor failed (the error names the cause), or it keeps dying
                await asyncio.sleep(1.0)
                self.workers.rollout[i] = self.workers.make_rollout(i)  # it died with the lost node, before it ran
        self.log(f"offstep: rollout replica {i} restarted on {await new.__ray_call__.remote(node_of)}")
