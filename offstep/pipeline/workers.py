"""The processes of a run: Ray, the trainer and rollout pools, the trainer roles (actor,
reference, critic) and the rollout replicas; their start-up and their shutdown.

:class:`Workers` is what the controller's loop receives. ``start_workers`` builds the real ones;
tests and benchmarks hand the loop simulated ones instead (``tests/fakes.py``), with the same
method names and results.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray

from offstep.config.schema import Config, rollout_sleeps
from offstep.errors import RolloutFailed, TrainerFailed
from offstep.models.loading import cache_dir
from offstep.pipeline.inputs import Inputs
from offstep.pipeline.pools import PLACEMENT_TIMEOUT_S, Pool, Rendezvous, RoleGroup, rebuild
from offstep.pipeline.ray_init import (
    init_ray,
    listen_summary,
)
from offstep.pipeline.run_dir import SCRATCH
from offstep.rollout.engines.build import EngineSpec
from offstep.rollout.replica_spec import RefSpec, RolloutSpec
from offstep.rollout.scoring.reward_worker import RewardWorker
from offstep.rollout.scoring.teacher_scoring import TeacherSpec, TeacherWorker
from offstep.rollout.worker import RolloutWorker
from offstep.telemetry.names import Role, replica
from offstep.telemetry.progress import LiveStatus
from offstep.train.actor import ActorWorker
from offstep.train.critic import CriticWorker
from offstep.train.fsdp import RoleWorker


@dataclass
class Workers:
    """Handles to every worker of a run. ``rollout[i]`` is replica i; ``make_rollout(i)`` starts
    a fresh replica i (the fleet replaces a dead one with it). ``ref`` is the group that gives the
    reference log-probs on the trainer pool (``ActorWorker.compute_ref_logprobs``): the actor's,
    from the frozen copy of the initial policy each rank holds beside the policy, or with LoRA from
    its model with the adapters off (None: no reference on the trainer pool)."""

    actor: RoleGroup
    rollout: list
    make_rollout: Callable[[int], Any]
    live: LiveStatus
    ref: RoleGroup | None = None
    critic: RoleGroup | None = None
    pools: list[Pool] = field(default_factory=list)
    owns_ray: bool = False  # this run started Ray, so it stops it
    host: str | None = None  # the address the run's own stores listen on (None: each node's address)
    rendezvous: Rendezvous | None = None  # the store the trainer roles' process groups meet at
    rollout_pool: Pool | None = None  # the pool the replicas' bundles belong to (replica i: bundle i % bundles)
    lend_cores: int = 0  # cores each trainer rank borrows while the rollout idles (pipeline.lend_cores; 0: none)
    reward: list = field(default_factory=list)  # the reward pool's workers (reward.model.placement=pool)
    reward_pool: Pool | None = None
    teacher: list = field(default_factory=list)  # the teacher pool's workers (distill.teacher.placement=pool)
    teacher_pool: Pool | None = None
    sleeps: bool = False  # the replicas sleep while the trainer updates (rollout.sleep_during_update)
    rebuilding: list = field(default_factory=list)  # reused workers' rebuilds under way (ObjectRefs)

    @property
    def groups(self) -> list[RoleGroup]:
        """Each role group once (the reference is the actor's group)."""
        out = []
        for g in (self.actor, self.ref, self.critic):
            if g is not None and all(g is not h for h in out):
                out.append(g)
        return out

    @property
    def stateful(self) -> list[RoleGroup]:
        """The roles whose weights and optimizer a checkpoint holds (the reference is frozen)."""
        return [g for g in (self.actor, self.critic) if g is not None]

    @property
    def sync_backend(self) -> str:
        """The weight-sync collective's backend: NCCL when both sides are on GPUs, else gloo."""
        return "nccl" if self.pools and all(p.device == "cuda" for p in self.pools) else "gloo"

    def roles(self) -> list[tuple[str, Any]]:
        """``(role, handle)`` of every worker: "rollout replica 0", "actor rank 0", ..."""
        roles = [(f"rollout replica {i}", w) for i, w in enumerate(self.rollout)]
        roles += [(f"reward worker {i}", w) for i, w in enumerate(self.reward)]
        roles += [(f"teacher worker {i}", w) for i, w in enumerate(self.teacher)]
        return roles + [(f"{g.name} rank {rank}", h) for g in self.groups for rank, h in enumerate(g.handles)]

    def ready(self) -> None:
        """Wait until every worker is constructed: a worker that fails to start fails here, with
        its own error, rather than at the first step. The error's ``role`` attribute names the
        worker ("rollout replica 0", "actor rank 0") for the message of ``controller.train``."""
        waits = [(role, h.__ray_ready__.remote()) for role, h in self.roles()]  # all start at once
        for role, started in waits:
            try:
                ray.get(started)
            except ray.exceptions.RayActorError as e:
                e.role = role
                raise
        ray.get(self.rebuilding)  # a kept worker that fails to rebuild raises its RayTaskError

    def placement_wait_s(self) -> float:
        """How long a replica's replacement may wait for a node (``resources.placement_timeout_s``)."""
        return self.rollout_pool.timeout_s if self.rollout_pool is not None else PLACEMENT_TIMEOUT_S

    def rollout_placed(self, i: int) -> bool:
        """Whether replica i's bundle sits on a live node (always, without a pool to ask)."""
        pool = self.rollout_pool
        return pool is None or pool.placed(i % pool.bundles)

    def placement(self) -> str:
        """Where each worker runs, as the worker itself reports it: "actor rank 0 on node
        1a2b3c4d (10.0.0.5), rollout replica 0 on node ..." (the first 8 hex digits of Ray's node id)."""
        roles = self.roles()
        nodes = ray.get([h.__ray_call__.remote(node_of) for _, h in roles])
        return ", ".join(f"{role} on {node}" for (role, _), node in zip(roles, nodes))

    def close(self, finished: bool = False) -> None:
        """Stop every worker and release the pools. ``finished``: the run ended normally (what a
        caller that keeps the processes for its next run needs: ``tests/keep_workers.py``)."""
        for g in self.groups:
            try:
                ray.get(g.submit(RoleWorker.shutdown), timeout=30)
            except Exception:  # a dead or hung worker: it is killed below
                pass
        self.live.close()
        for g in self.groups:
            g.kill()
        for w in [*self.rollout, *self.reward, *self.teacher]:
            ray.kill(w)
        for p in [*self.pools, *(p for p in (self.reward_pool, self.teacher_pool) if p is not None)]:
            p.remove()
        if self.owns_ray:
            ray.shutdown()


@dataclass
class Processes:
    """Live worker processes of an earlier run on this Ray, their objects emptied, for a run of the
    same shape to build its workers in (``start_workers(reuse=...)``): its pools (the trainer's,
    then the rollout's), each trainer role's ranks by role name, and its replicas."""

    pools: list
    roles: dict[str, list]
    rollout: list


def node_of(_worker) -> str:
    """Run inside a worker (``__ray_call__``): its Ray node, "node 1a2b3c4d (10.0.0.5)"."""
    return f"node {ray.get_runtime_context().get_node_id()[:8]} ({ray.util.get_node_ip_address()})"


_ROLES = {
    ActorWorker.__name__: Role.ACTOR,
    CriticWorker.__name__: Role.CRITIC,
    RolloutWorker.__name__: "rollout replica",
    RewardWorker.__name__: "reward worker",
    TeacherWorker.__name__: "teacher worker",
}


def worker_failure(e: ray.exceptions.RayActorError) -> tuple[str, str, bool]:
    """(role, cause, whether it failed to start) of a dead worker, from Ray's error: a banner,
    then (when the constructor raised) the worker's traceback and, last, its exception; or, when
    the process died, its exit type and detail. The traceback itself is left out (Ray logs it)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    lines = text.splitlines() or [type(e).__name__]
    frames = [i for i, line in enumerate(lines) if line.lstrip().startswith('File "')]
    init_failed = getattr(e, "actor_init_failed", False)
    if init_failed and frames:
        tail = lines[frames[-1] + 1 :]
        while tail and tail[0].startswith(" "):  # the frame's code line and Python's ^^^ markers
            tail.pop(0)
        cause = " ".join(line.strip() for line in tail) or lines[0]
    else:
        exit_detail = re.search(r"Worker exit type: (.*?)(?: Some common causes|$)", text, re.S)
        cause = lines[0] + (f" (worker exit type: {exit_detail.group(1).strip()})" if exit_detail else "")
    worker_class = re.search(r"class_name: (\w+)|ray::(\w+)\.", text)
    role = getattr(e, "role", None) or _ROLES.get(
        worker_class and (worker_class.group(1) or worker_class.group(2)), Role.TRAINER
    )
    return role, cause, init_failed or hasattr(e, "role")


def failure(e: ray.exceptions.RayActorError, checkpoints: list) -> RolloutFailed | TrainerFailed:
    """The error a run ends with when a worker died (``checkpoints``: the run's complete ones)."""
    role, cause, failed_start = worker_failure(e)
    if failed_start:
        problem = f"the {role} worker failed to start: {cause}. Fix that (the worker's log above has the traceback)"
    else:
        last = (
            f"the last checkpoint, {checkpoints[-1][1]}, is intact: continue with trainer.resume=auto"
            if checkpoints
            else "no checkpoint was written (set trainer.save_freq to write them as the run goes)"
        )
        problem = f"the {role} worker died: {cause}; {last}"
    return (RolloutFailed if role.startswith(Role.ROLLOUT) else TrainerFailed)(problem)


def start_reward_pool(cfg: Config, env: dict) -> tuple[Pool | None, list]:
    """The reward pool and its workers (``reward.model.placement=pool``), or (None, []). Ray starts
    a worker that dies again in its bundle (``reward.model.max_restarts`` times), under the same handle."""
    m, res = cfg.reward.model, cfg.resources
    if m.kind is None or m.placement != "pool":
        return None, []
    pool = Pool.create(
        Role.REWARD,
        res.reward_workers,
        res.cpus_per_reward_worker,
        res.gpus_per_reward_worker,
        timeout_s=res.placement_timeout_s,
    )
    remote = ray.remote(RewardWorker)
    env = {**env, "OMP_NUM_THREADS": str(pool.cpus_per_bundle)}
    return pool, [
        remote.options(max_restarts=m.max_restarts, **pool.options(i, 1.0, env)).remote(
            m, pool.device, pool.cpus_per_bundle
        )
        for i in range(pool.bundles)
    ]


def start_teacher_pool(cfg: Config, spec: TeacherSpec | None, env: dict) -> tuple[Pool | None, list]:
    """The teacher pool and its workers (``distill.teacher.placement=pool``), or (None, [])."""
    res = cfg.resources
    if spec is None or cfg.distill.teacher.placement != "pool":
        return None, []
    pool = Pool.create(
        Role.TEACHER,
        res.teacher_workers,
        res.cpus_per_teacher_worker,
        res.gpus_per_teacher_worker,
        timeout_s=res.placement_timeout_s,
    )
    remote = ray.remote(TeacherWorker)
    env = {**env, "OMP_NUM_THREADS": str(pool.cpus_per_bundle)}
    return pool, [
        remote.options(**pool.options(i, 1.0, env)).remote(spec, pool.device, pool.cpus_per_bundle)
        for i in range(pool.bundles)
    ]


def start_workers(
    cfg: Config,
    inputs: Inputs,
    console,
    rollout_class: Callable[[int], type] = lambda i: RolloutWorker,
    reuse: Processes | None = None,
) -> Workers:
    """Place the pools and start every role on them (one bundle per trainer rank or replica).
    ``rollout_class(i)``: the class replica ``i``'s actor runs (a test gives one a subclass that
    injects a fault). ``reuse``: the processes of an earlier run of the same shape, in which this
    run's workers are built instead of starting new ones (the test suite's keeper,
    ``tests/keep_workers.py``); should one of them have died, the run starts afresh."""
    res, ro, k = cfg.resources, cfg.rollout, cfg.pipeline.max_staleness
    console.log("offstep: starting Ray and the worker pools")
    owns_ray = init_ray(cfg)
    if cfg.resources.ray_address:  # the cluster's own settings decide what Ray listens on: say what they are
        console.log(f"offstep: {listen_summary(ray.util.get_node_ip_address())}")
    colocate = cfg.pipeline.colocate and k == 0
    ref_on_trainer = cfg.algorithm.needs_reference and not cfg.pipeline.ref_on_rollout
    lora = cfg.actor.lora if cfg.actor.lora.rank > 0 else None
    use_critic = cfg.algorithm.adv_estimator == "gae"
    # Roles sharing a trainer bundle take turns on its cores; each takes an equal GPU share.
    share = 1.0 / (1 + use_critic + colocate)
    env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OFFSTEP_CACHE": str(cache_dir())}
    # pipeline.lend_cores: the rollout pool's cores, shared out over the trainer's ranks while it idles
    lend = (ro.replicas * ro.cpus_per_replica) // res.trainer_workers if cfg.pipeline.lend_cores and not colocate else 0
    trainer_spec = (
        Role.TRAINER,
        res.trainer_workers,
        res.cpus_per_trainer_worker,
        res.gpus_per_trainer_worker,
        res.custom_resources_per_trainer_worker,
        "resources.custom_resources_per_trainer_worker",
        res.placement_timeout_s,
    )
    rollout_spec = (
        None
        if colocate
        else (
            Role.ROLLOUT,
            ro.replicas,
            ro.cpus_per_replica,
            ro.gpus_per_replica,
            ro.custom_resources_per_replica,
            "rollout.custom_resources_per_replica",
            res.placement_timeout_s,
        )
    )
    trainer_pool = reuse.pools[0] if reuse else Pool.create(*trainer_spec)
    try:
        rollout_pool = None if colocate else reuse.pools[1] if reuse else Pool.create(*rollout_spec)
    except BaseException:  # placed for nothing, the trainer's pool would hold its cores and its name
        if not reuse:
            trainer_pool.remove()
        raise
    live = LiveStatus.create(console)
    ref_spec = (
        RefSpec(
            cfg.model.dtype,
            cfg.model.compute_dtype,
            ro.temperature,
            cfg.actor.micro_batch_size,
            cfg.actor.share_prompts,
        )
        if cfg.algorithm.needs_reference and cfg.pipeline.ref_on_rollout
        else None
    )
    model = (inputs.model_path, cfg.model.dtype, cfg.model.compute_dtype)
    seed, temperature = cfg.trainer.seed, ro.temperature
    micro, budget = cfg.actor.micro_batch_size, cfg.actor.micro_token_budget
    host = None if cfg.resources.ray_address else "127.0.0.1"  # a local run listens on loopback only
    rendezvous = Rendezvous(host or ray.util.get_node_ip_address())
    roles = dict(reuse=reuse.roles if reuse else {}, lendable=lend > 0)
    actor = RoleGroup.create(
        Role.ACTOR,
        ActorWorker,
        trainer_pool,
        share,
        env,
        rendezvous,
        seed,
        *model,
        cfg.actor,
        cfg.algorithm,
        temperature,
        live.client(Role.TRAINER),
        ref_on_trainer,
        cfg.distill,
        cfg.trainer.total_steps,
        **roles,
    )
    ref = actor if ref_on_trainer else None  # the actor's frozen copy, or with LoRA its base
    critic = (
        RoleGroup.create(
            Role.CRITIC,
            CriticWorker,
            trainer_pool,
            share,
            env,
            rendezvous,
            seed,
            *model,
            cfg.critic,
            cfg.algorithm,
            micro,
            cfg.actor.mini_batch_size,
            budget,
            cfg.trainer.total_steps,
            **roles,
        )
        if use_critic
        else None
    )
    pool = rollout_pool or trainer_pool
    reward_pool, reward_workers = start_reward_pool(cfg, env)
    teacher = TeacherSpec.of(cfg, inputs.teacher_path) if inputs.teacher_path else None
    teacher_pool, teacher_workers = start_teacher_pool(cfg, teacher, env)
    sleeps = rollout_sleeps(cfg)

    engine = EngineSpec(
        ro.engine,
        inputs.model_path,
        ro.dtype,
        ro.max_batch_size,
        pool.cpus_per_bundle,
        cfg.trainer.seed,
        lora,
        sleeps,
        str(Path(cfg.trainer.output_dir).resolve() / SCRATCH),
    )
    spec = RolloutSpec(
        engine,
        pool.device,
        inputs.reward,
        cfg.reward.num_threads,
        ref_spec,
        inputs.agent,
        cfg.sandbox,
        cfg.reward.model if cfg.reward.model.kind is not None else None,
        teacher,
    )

    def rollout_args(i: int) -> tuple:
        return spec, live.client(replica(i)), reward_workers, teacher_workers

    actor_classes: dict[type, Any] = {}

    def make_rollout(i: int):
        opts = pool.options(
            i % pool.bundles, share if colocate else 1.0, {**env, "OMP_NUM_THREADS": str(pool.cpus_per_bundle)}
        )
        if cfg.pipeline.mode == "fully_async":  # loads and takes are served while the engine generates
            opts["max_concurrency"] = 4
        cls = rollout_class(i)
        if cls not in actor_classes:
            actor_classes[cls] = ray.remote(cls)
        return actor_classes[cls].options(**opts).remote(*rollout_args(i))

    if reuse:
        rollout = reuse.rollout
        rebuilding = [h.__ray_call__.remote(rebuild, *rollout_args(i)) for i, h in enumerate(rollout)]
    else:
        rollout, rebuilding = [make_rollout(i) for i in range(ro.replicas)], []
    workers = Workers(
        actor,
        rollout,
        make_rollout,
        live,
        ref,
        critic,
        [p for p in (trainer_pool, rollout_pool) if p is not None],
        owns_ray,
        host,
        rendezvous,
        rollout_pool=pool,
        lend_cores=lend,
        reward=reward_workers,
        reward_pool=reward_pool,
        teacher=teacher_workers,
        teacher_pool=teacher_pool,
        sleeps=sleeps,
        rebuilding=[*rebuilding, *(r for g in (actor, ref, critic) if g is not None for r in g.rebuilding)],
    )
    try:
        workers.ready()
        if cfg.resources.ray_address:  # on a cluster, say which node each worker landed on
            console.log(f"offstep: placement: {workers.placement()}")
    except BaseException as e:
        workers.close()
        if reuse and isinstance(e, ray.exceptions.RayError):  # a reused worker died or failed to rebuild: start afresh
            return start_workers(cfg, inputs, console, rollout_class)
        raise
    return workers
