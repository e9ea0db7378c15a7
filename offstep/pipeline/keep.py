"""Worker processes kept from one run to the next in one driver process (``keep_workers``).

Each run starts its workers as fresh Ray actors, and each of those processes imports torch and
transformers and loads its tokenizer and model before the first step: 4-6 s of CPU per worker,
most of a short run on 2 cores. A driver that runs many runs one after another on one Ray instance
(a sweep in a notebook, the test suite) can keep them. Inside ``with keep_workers():``

- a run that ends normally (``train`` returned) leaves its placement groups and worker processes
  alive, each worker's object emptied (its process group, threads and model released: ``empty``);
- the next run of the same ``shape`` (the same pools, roles, worker classes and process options:
  what a worker process is fixed to when Ray starts it) builds its workers again inside those
  processes, from its own arguments, with the constructor a fresh start runs (``rebuild``);
- up to ``sets`` finished runs of different shapes stay kept side by side; a run whose own pools
  do not fit beside them releases them (kills the actors, removes the placement groups), least
  recently used first, until they fit. A run that fails releases the set it took, and leaving the
  block releases them all.

Only runs whose workers hold nothing outside their own objects are kept (``keepable``): the
built-in engine (a vLLM engine keeps threads and processes of its own), no agents, no reward
model, object-store weight syncs (a collective's process groups and stores), batch mode (a
streaming replica's calls may still be waiting for a thread), on a local Ray that outlives the run.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ray

from offstep.config.schema import Config


@dataclass
class Kept:
    """A finished run's workers, alive and empty: its pools, each role's ranks, its replicas."""

    shape: tuple
    cluster: str  # the Ray node the driver was connected to: the handles belong to that Ray instance
    pools: list  # offstep.pipeline.pools.Pool, the trainer's then the rollout's
    roles: dict[str, list]  # role name -> its ranks' handles
    rollout: list

    def holds(self) -> dict[str, float]:
        """The cores and GPUs its pools' placement groups hold."""
        return {"CPU": sum(p.bundles * p.cpus_per_bundle for p in self.pools),
                "GPU": sum(p.bundles * p.gpus_per_bundle for p in self.pools)}

    def release(self) -> None:
        if ray.is_initialized() and cluster() == self.cluster:
            for h in [*(h for hs in self.roles.values() for h in hs), *self.rollout]:
                ray.kill(h)
            for p in self.pools:
                p.remove()


_keeping = False
_sets = 1
_kept: list[Kept] = []  # least recently used first
ROOM_WAIT_S = 10.0  # how long a released set's cores may take to show as free in Ray's accounting


@contextmanager
def keep_workers(sets: int = 1) -> Iterator[None]:
    """Keep finished runs' workers, of up to ``sets`` shapes, for the next runs of the same shapes
    (see the module's doc)."""
    global _keeping, _sets
    if sets < 1:
        raise ValueError(f"keep_workers(sets={sets}): keep at least one set")
    _keeping, _sets = True, sets
    try:
        yield
    finally:
        _keeping, _sets = False, 1
        release()


def keepable(cfg: Config, has_agent: bool) -> bool:
    """Whether this run's workers may be kept and reused (``keep_workers`` active, and they hold
    nothing outside their own objects)."""
    return (_keeping and not cfg.resources.ray_address and cfg.rollout.engine == "builtin" and not has_agent
            and cfg.reward.model.kind is None and cfg.pipeline.weight_sync == "object_store"
            and cfg.pipeline.mode == "batch")


def take(shape: tuple | None, need: dict[str, float] | None = None) -> Kept | None:
    """The kept workers of ``shape``, taken out of the kept sets (None: none, or this run keeps
    nothing). Without them, kept sets are released, least recently used first, until the Ray
    resources ``need`` (this run's pools) are free beside the rest."""
    global _kept
    if not ray.is_initialized():
        _kept = []
        return None
    here = cluster()
    _kept = [k for k in _kept if k.cluster == here]  # the others went with their Ray
    for kept in _kept:
        if shape is not None and kept.shape == shape:
            _kept.remove(kept)
            return kept
    while _kept and not _room(need or {}, wait_s=0.0):
        before = ray.available_resources()
        gone = _kept.pop(0)
        gone.release()
        # Its cores show as free in Ray's accounting a moment after the release.
        _room({r: before.get(r, 0.0) + a for r, a in gone.holds().items()}, wait_s=ROOM_WAIT_S)
    return None


def park(kept: Kept) -> None:
    """Keep these workers (already emptied) for the next run; past ``sets`` sets, the least
    recently used one is released."""
    _kept.append(kept)
    while len(_kept) > _sets:
        _kept.pop(0).release()


def release() -> None:
    """Release every kept worker."""
    global _kept
    kept, _kept = _kept, []
    for k in kept:
        k.release()


def kept_sets() -> list[Kept]:
    """The kept sets, least recently used first."""
    return list(_kept)


def _room(need: dict[str, float], wait_s: float) -> bool:
    """Whether Ray has ``need`` free now, or within ``wait_s`` (a removed placement group's
    resources come back in Ray's accounting a moment later)."""
    deadline = time.monotonic() + wait_s
    while True:
        free = ray.available_resources()
        if all(free.get(r, 0.0) >= a - 1e-9 for r, a in need.items()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def cluster() -> str:
    """The Ray instance this driver is connected to (the node it joined: a fresh id per start)."""
    return ray.get_runtime_context().get_node_id()


def rebuild(worker, *args, **kwargs) -> None:
    """Run inside a kept worker (``__ray_call__``): its object built again from a new run's
    arguments, by the constructor a fresh start runs, on an empty object."""
    worker.__dict__.clear()
    type(worker).__init__(worker, *args, **kwargs)


def empty(worker) -> None:
    """Run inside a worker that is kept (``__ray_call__``), after its role's own shutdown: drop
    everything its object holds, so that the next run starts from nothing."""
    worker.__dict__.clear()
    gc.collect()
