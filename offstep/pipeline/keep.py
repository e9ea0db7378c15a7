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
- a run of another shape releases them first (kills the actors, removes the placement groups), as
  does a run that fails, and leaving the block.

Only runs whose workers hold nothing outside their own objects are kept (``keepable``): the
built-in engine (a vLLM engine keeps threads and processes of its own), no agents, no reward
model, object-store weight syncs (a collective's process groups and stores), batch mode (a
streaming replica's calls may still be waiting for a thread), on a local Ray that outlives the run.
"""

from __future__ import annotations

import gc
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

    def release(self) -> None:
        if ray.is_initialized() and cluster() == self.cluster:
            for h in [*(h for hs in self.roles.values() for h in hs), *self.rollout]:
                ray.kill(h)
            for p in self.pools:
                p.remove()


_keeping = False
_kept: Kept | None = None


@contextmanager
def keep_workers() -> Iterator[None]:
    """Keep a finished run's workers for the next run of the same shape (see the module's doc)."""
    global _keeping
    _keeping = True
    try:
        yield
    finally:
        _keeping = False
        release()


def keepable(cfg: Config, has_agent: bool) -> bool:
    """Whether this run's workers may be kept and reused (``keep_workers`` active, and they hold
    nothing outside their own objects)."""
    return (
        _keeping
        and not cfg.resources.ray_address
        and cfg.rollout.engine == "builtin"
        and not has_agent
        and cfg.reward.model.kind is None
        and not cfg.distill.enabled
        and cfg.pipeline.weight_sync == "object_store"
        and cfg.pipeline.mode == "batch"
    )


def take(shape: tuple | None) -> Kept | None:
    """The kept workers if they have ``shape`` (None: this run keeps nothing); kept workers of
    another shape are released."""
    global _kept
    kept, _kept = _kept, None
    if kept is None or not ray.is_initialized() or cluster() != kept.cluster:  # none, or gone with their Ray
        return None
    if shape is not None and kept.shape == shape:
        return kept
    kept.release()
    return None


def park(kept: Kept) -> None:
    """Keep these workers (already emptied) for the next run."""
    global _kept
    release()
    _kept = kept


def release() -> None:
    """Release the kept workers, if any."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None:
        kept.release()


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
