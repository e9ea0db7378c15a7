"""The rollout replicas as one fleet: a generation call is split across them in contiguous
shares, each share with its own seed, and a replica that dies, or does not answer within
``rollout.timeout_s``, is replaced and its share generated again with the same seed."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import ray

from offstep.config.schema import RolloutConfig
from offstep.errors import OffstepError
from offstep.pipeline.inputs import to_request
from offstep.pipeline.workers import Workers, node_of


class RolloutFailed(OffstepError):
    """Generation could not be completed (rollout workers died or hung too often)."""


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
    def __init__(self, workers: Workers, cfg: RolloutConfig, reload: Callable[[int], Awaitable[None]], log: Callable[[str], None],
                 restarts: int = 0):
        self.workers, self.cfg, self.reload, self.log = workers, cfg, reload, log
        self.restarts = restarts  # replicas replaced so far in this run (a checkpoint carries it)

    def submit(self, prompts, params, seed_base: int, batch_idx: int, uid0: int, with_ref: bool = True) -> asyncio.Future:
        """Generate ``params.n`` samples of each prompt; the future gives one ``(samples,
        GenTiming)`` per replica that had a share, in replica order.

        The replicas' calls are submitted before this returns, not when the event loop next runs
        the future: a replica runs its calls in submission order, so a weight load (or a receive
        on the collective path) submitted after this call is ordered after this generation."""
        requests = [to_request(p, uid0 + i) for i, p in enumerate(prompts)]
        shares = []
        for i, share in enumerate(split(requests, len(self.workers.rollout))):
            if share:
                args = (share, params, gen_seed(seed_base, batch_idx, i), with_ref)
                shares.append(self._generate_on(i, args, self.workers.rollout[i].generate.remote(*args)))
        return asyncio.ensure_future(asyncio.gather(*shares))

    async def _generate_on(self, i: int, args: tuple, call):
        while True:
            try:
                return await asyncio.wait_for(_await(call), self.cfg.timeout_s)
            except asyncio.TimeoutError:
                await self._restart(i, f"did not finish a generation within rollout.timeout_s={self.cfg.timeout_s:g}")
            except ray.exceptions.RayActorError as e:
                await self._restart(i, f"died ({type(e).__name__})")
            call = self.workers.rollout[i].generate.remote(*args)  # the same requests and seed, on the new replica

    async def _restart(self, i: int, why: str) -> None:
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
        """Wait until replica i's replacement is up, at most ``rollout.timeout_s``: one that no
        node can hold (its node left the cluster and no other node has room for its bundle) would
        otherwise wait for a node forever."""
        new = self.workers.rollout[i]
        try:
            await asyncio.wait_for(_await(new.__ray_ready__.remote()), self.cfg.timeout_s)
        except asyncio.TimeoutError:
            raise RolloutFailed(
                f"rollout worker {i} {why}, and its replacement did not start within rollout.timeout_s="
                f"{self.cfg.timeout_s:g}: no node of the Ray cluster has room for it (when its node left the cluster, "
                f"only a node with the rollout pool's resources, rollout.cpus_per_replica, gpus_per_replica and "
                f"custom_resources_per_replica, can take it). Add such a node, and resume from the last checkpoint "
                f"with trainer.resume=auto"
            ) from None
        self.log(f"offstep: rollout replica {i} restarted on {await new.__ray_call__.remote(node_of)}")
