"""Worker processes kept from one run to the next in the test session's driver (``keep_workers``).

Each run starts its workers as fresh Ray actors, and each of those processes imports torch and
transformers and loads its tokenizer and model before the first step: 4-6 s of CPU per worker,
most of a short test run on 2 cores. The session's Ray (``conftest.ray_session``) keeps them, by
wrapping the run's start (``offstep.pipeline.controller.start_workers``, the seam that
``train(cfg, start=...)`` also takes). Inside ``with keep_workers():``

- a run that ends normally (``train`` returned) leaves its placement groups and worker processes
  alive, each worker's object emptied (its process group, threads and model released: ``empty``);
- the next run of the same ``shape`` (the same pools, roles, worker classes and process options:
  what a worker process is fixed to when Ray starts it) builds its workers again inside those
  processes, from its own arguments, with the constructor a fresh start runs
  (``start_workers(reuse=...)``);
- a run of another shape releases them first (kills the actors, removes the placement groups), as
  does a run that fails, and leaving the block.

Only runs whose workers hold nothing outside their own objects are kept (``keepable``): the
built-in engine (a vLLM engine keeps threads and processes of its own), no agents, no reward
model, no teacher, object-store weight syncs (a collective's process groups and stores), batch
mode (a streaming replica's calls may still be waiting for a thread), on a local Ray that outlives
the run. The product never keeps anything: this module is the tests' (and ``benchmarks.keep_workers``').
"""

from __future__ import annotations

import dataclasses
import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import ray

from offstep.config.schema import Config
from offstep.pipeline import controller
from offstep.pipeline.workers import Processes, Workers, start_workers
from offstep.rollout.worker import RolloutWorker
from offstep.train.fsdp import RoleWorker


@dataclass
class Kept:
    """A finished run's workers, alive and empty, and what they are fixed to."""

    shape: tuple
    cluster: str  # the Ray node the driver was connected to: the handles belong to that Ray instance
    processes: Processes

    def release(self) -> None:
        if ray.is_initialized() and cluster() == self.cluster:
            p = self.processes
            for h in [*(h for hs in p.roles.values() for h in hs), *p.rollout]:
                ray.kill(h)
            for pool in p.pools:
                pool.remove()


_kept: Kept | None = None


def keepable(cfg: Config, has_agent: bool) -> bool:
    """Whether this run's workers hold nothing outside their own objects (see the module's doc)."""
    return (
        not cfg.resources.ray_address
        and cfg.rollout.engine == "builtin"
        and not has_agent
        and cfg.reward.model.kind is None
        and not cfg.distill.enabled
        and cfg.pipeline.weight_sync == "object_store"
        and cfg.pipeline.mode == "batch"
    )


def shape_of(cfg: Config, rollout_class) -> tuple:
    """What a run's worker processes are fixed to when Ray starts them: the pools (the trainer's
    resources, the replicas and theirs), whether they share the trainer's bundles and lend cores,
    whether there is a critic, and each replica's class."""
    ro, p = cfg.rollout, cfg.pipeline
    pools = (
        dataclasses.asdict(cfg.resources),
        (ro.replicas, ro.cpus_per_replica, ro.gpus_per_replica, repr(ro.custom_resources_per_replica)),
        p.colocate and p.max_staleness == 0,
        p.lend_cores,
        cfg.algorithm.adv_estimator == "gae",
    )
    return repr(pools), tuple(rollout_class(i) for i in range(ro.replicas))


def take(shape: tuple | None) -> Processes | None:
    """The kept processes if they have ``shape`` (None: this run keeps nothing); processes kept
    with another shape are released, so that their cores are free for this run."""
    global _kept
    kept, _kept = _kept, None
    if kept is None or not ray.is_initialized() or cluster() != kept.cluster:  # none, or gone with their Ray
        return None
    if shape is not None and kept.shape == shape:
        return kept.processes
    kept.release()
    return None


def release() -> None:
    """Release the kept workers, if any."""
    global _kept
    kept, _kept = _kept, None
    if kept is not None:
        kept.release()


def cluster() -> str:
    """The Ray instance this driver is connected to (the node it joined: a fresh id per start)."""
    return ray.get_runtime_context().get_node_id()


def empty(worker) -> None:
    """Run inside a worker that is kept (``__ray_call__``), after its role's own shutdown: drop
    everything its object holds, so that the next run starts from nothing."""
    worker.__dict__.clear()
    gc.collect()


class KeptWorkers(Workers):
    """A run's workers whose ``close`` keeps them (emptied) when the run finished normally."""

    shape: tuple

    def close(self, finished: bool = False) -> None:
        if not (finished and self._park()):
            super().close(finished)

    def _park(self) -> bool:
        """Shut down and empty every worker, and keep them; False if one of them fails to (then
        ``close`` stops them all)."""
        global _kept
        try:
            ray.get(
                [
                    *(h for g in self.groups for h in g.submit(RoleWorker.shutdown)),
                    *(w.close.remote() for w in self.rollout),
                ],
                timeout=30,
            )
            ray.get([h.__ray_call__.remote(empty) for _, h in self.roles()], timeout=30)
        except Exception:
            return False
        self.live.close()
        release()
        processes = Processes(list(self.pools), {g.name: g.handles for g in self.groups}, list(self.rollout))
        _kept = Kept(self.shape, cluster(), processes)
        return True


def start_keeping(cfg: Config, inputs, console, rollout_class=lambda i: RolloutWorker) -> Workers:
    """``start_workers``, in the processes a run of the same shape kept where there are some, and
    keeping this run's for the next one when it finishes normally."""
    shape = shape_of(cfg, rollout_class) if keepable(cfg, inputs.agent is not None) else None
    reuse = take(shape)  # releases what a run of another shape kept
    workers = start_workers(cfg, inputs, console, rollout_class, reuse=reuse)
    if shape is not None and not workers.owns_ray:  # a run that started Ray takes it down with it
        workers.__class__ = KeptWorkers
        workers.shape = shape
    return workers


@contextmanager
def keep_workers() -> Iterator[None]:
    """Runs started inside keep their workers for the next run of the same shape (see the module's doc)."""
    ray.cloudpickle.register_pickle_by_value(
        sys.modules[__name__]
    )  # ``empty`` runs in the workers, which cannot import tests/
    real = controller.start_workers
    controller.start_workers = start_keeping
    try:
        yield
    finally:
        controller.start_workers = real
        release()
