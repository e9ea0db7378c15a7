"""Resource pools as Ray placement groups, and role groups of Ray actors placed on them.

On CPU a pool's "device" is a bundle of cores; on GPU a GPU. The trainer pool hosts the actor,
reference and critic groups (each an FSDP2 process group over the pool's bundles); the rollout
pool hosts the rollout replicas. In synchronous mode the rollout replicas may be colocated on the
trainer pool instead, taking turns with the trainer on the same cores.

On a cluster, a pool is pinned to some nodes by a custom Ray resource that only those nodes have
(``resources.custom_resources_per_trainer_worker``, ``rollout.custom_resources_per_replica``):
each bundle takes that much of it, so ``{node_train: 1}`` on nodes given ``node_train: 1`` places
one trainer rank per such node. ``check_placeable`` refuses a pool that no node can hold before
Ray would wait for one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from offstep.dist import serve_store
from offstep.errors import PlacementFailed
from offstep.train.distributed import GroupSpec

# Actors take a token share of a bundle; the bundle itself reserves the cores, and each actor
# sets its own thread count. This lets several roles share one bundle (they run in turn).
_TOKEN_CPU = 0.01
LEND_GROUP = "lend"  # the trainer actors' concurrency group that takes lent cores (pipeline.lend_cores)
PLACEMENT_TIMEOUT_S = 60.0  # resources.placement_timeout_s's default


def check_placeable(nodes: list[dict], spec: dict[str, float], custom_key: str) -> str | None:
    """Why no live node of ``nodes`` (``ray.nodes()``: "Alive", "NodeID", "Resources" totals)
    could ever hold one bundle of ``spec``, or None. Checked for a bundle with custom resources
    (asked for by the config key ``custom_key``) only: without them the placement's own wait
    reports a shortage, including resources that other runs hold now."""
    live = [n for n in nodes if n.get("Alive")]
    standard = ("CPU", "GPU", "memory", "object_store_memory")
    custom = {r: a for r, a in spec.items() if r not in standard}
    if not custom:
        return None
    if any(all(n["Resources"].get(r, 0) >= a for r, a in spec.items()) for n in live):
        return None
    have = {
        n["NodeID"][:8]: {r: v for r, v in n["Resources"].items() if r not in standard and not r.startswith("node:")}
        for n in live
    }
    missing = [r for r in custom if not any(r in n["Resources"] for n in live)]
    why = (
        f"no node of the Ray cluster has the resource {missing[0]!r}"
        if missing
        else f"no single node of the Ray cluster has all of {spec} (each bundle is placed on one node)"
    )
    return (
        f"{custom_key}={custom}: {why}; the nodes' custom resources are {have}. Fix: start those nodes with "
        f"the resource (ray start --resources='{json.dumps(custom)}'), or change {custom_key}"
    )


@dataclass
class Pool:
    pg: PlacementGroup
    bundles: int
    cpus_per_bundle: int
    gpus_per_bundle: int
    timeout_s: float = PLACEMENT_TIMEOUT_S  # how long it, or a bundle of it whose node left, may wait for a node

    @classmethod
    def create(
        cls,
        name: str,
        bundles: int,
        cpus: int,
        gpus: int,
        custom: dict[str, float] | None = None,
        custom_key: str = "",
        timeout_s: float = PLACEMENT_TIMEOUT_S,
    ) -> "Pool":
        """Place ``bundles`` bundles of ``cpus`` cores, ``gpus`` GPUs and the ``custom`` Ray
        resources (asked for by the config key ``custom_key``) each."""
        spec = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **(custom or {})}
        problem = check_placeable(ray.nodes(), spec, custom_key)
        if problem:
            raise PlacementFailed(f"the {name} pool cannot be placed: {problem}")
        pg = placement_group([dict(spec) for _ in range(bundles)], strategy="PACK", name=name)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise PlacementFailed(
                f"the {name} pool ({bundles} x {spec}) could not be placed within {timeout_s:.0f} s; "
                f"the Ray cluster has {ray.available_resources()}. Lower resources.* / rollout.replicas, or wait "
                f"longer for nodes (resources.placement_timeout_s)."
            )
        return cls(pg, bundles, cpus, gpus, timeout_s)

    def options(self, bundle: int, gpu_share: float = 0.0, env: dict | None = None) -> dict:
        return dict(
            num_cpus=_TOKEN_CPU,
            num_gpus=gpu_share if self.gpus_per_bundle else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=bundle
            ),
            runtime_env={"env_vars": env or {}},
        )

    def placed(self, bundle: int) -> bool:
        """Whether ``bundle`` sits on a live node now. When its node leaves the cluster, Ray places
        it again as soon as a node has room for it."""
        node = ray.util.placement_group_table(self.pg).get("bundles_to_node_id", {}).get(bundle)
        return node is not None and any(n["NodeID"] == node and n.get("Alive") for n in ray.nodes())

    @property
    def device(self) -> str:
        return "cuda" if self.gpus_per_bundle else "cpu"

    def remove(self) -> None:
        remove_placement_group(self.pg)


class Rendezvous:
    """The store every role group of a run meets at, served by the driver for the run's lifetime
    (each group under its own prefix), listening on ``host`` only: 127.0.0.1 for a local run, the
    driver's node address on a cluster. No process of its own."""

    def __init__(self, host: str):
        self.host = host
        self.store = serve_store(host, None)

    @property
    def endpoint(self) -> tuple[str, int]:
        return self.host, self.store.port


def rebuild(worker, *args, **kwargs) -> None:
    """Run inside a live worker of an earlier run (``__ray_call__``): its object built again from
    this run's arguments, by the constructor a fresh start runs, on an empty object."""
    worker.__dict__.clear()
    type(worker).__init__(worker, *args, **kwargs)


class RoleGroup:
    """The ranks of one trainer role, spread one per bundle of a pool."""

    def __init__(self, name: str, handles: list, rebuilding: list | None = None):
        self.name, self.handles = name, handles
        self.rebuilding = rebuilding or []  # reused ranks being built again for this run (start_workers(reuse=...))

    @classmethod
    def create(
        cls,
        name: str,
        worker_cls,
        pool: Pool,
        gpu_share: float,
        env: dict,
        rendezvous: Rendezvous,
        *args,
        lendable: bool = False,
        reuse: dict[str, list] | None = None,
    ) -> "RoleGroup":
        """``lendable``: each rank also serves ``lend_threads`` in a concurrency group of its own
        (``LEND_GROUP``), beside the call it is running; its other calls stay one at a time.
        ``reuse``: live ranks of an earlier run of the same shape, by role name, built again for this
        run instead (``start_workers(reuse=...)``)."""
        reuse = (reuse or {}).get(name)
        remote_cls = ray.remote(concurrency_groups={LEND_GROUP: 1})(worker_cls) if lendable else ray.remote(worker_cls)
        master_addr, port = rendezvous.endpoint
        handles, rebuilding = [], []
        for rank in range(pool.bundles):
            spec = GroupSpec(
                rank=rank,
                world_size=pool.bundles,
                master_addr=master_addr,
                master_port=port,
                group=name,
                device=pool.device,
                num_threads=pool.cpus_per_bundle,
            )
            if reuse:
                rebuilding.append(reuse[rank].__ray_call__.remote(rebuild, spec, *args))
            else:
                opts = pool.options(rank, gpu_share, env)
                handles.append(remote_cls.options(name=f"{name}-{rank}", **opts).remote(spec, *args))
        return cls(name, list(reuse) if reuse else handles, rebuilding)

    def submit(self, method: Callable, *args) -> list:
        """Call ``method``, the worker class's own (``ActorWorker.update``), on every rank; its
        futures. A method, not its name as a string: a misspelt or renamed one fails where it is named
        (and in a type checker), not inside Ray."""
        return [getattr(h, method.__name__).remote(*args) for h in self.handles]

    async def run(self, method: Callable, *args):
        """Call ``method`` on every rank (a collective); return rank 0's result."""
        results = await asyncio.gather(*self.submit(method, *args))
        return results[0]

    def kill(self) -> None:
        for h in self.handles:
            ray.kill(h)
