"""The controller: one asyncio loop that owns the order of generation, training and weight sync.

With ``pipeline.max_staleness = k`` generation runs up to k batches ahead of training:

    k = 1   rollout: [gen b1 @v0][gen b2 @v0 ][gen b3 @v1 ][gen b4 @v2 ]...
            trainer:             [train b1 → v1]sync[train b2 → v2]sync...

k = 0 is the synchronous loop. Every sample carries the policy version that generated it (the
rollout worker tags it); ``check_staleness`` is the one place the bound is enforced.

Off the critical path: a batch is prepared (collated, measured and, when the trainer has nothing
to add, given its advantages and put in the object store) as soon as its samples arrive, while the
trainer still updates on the batch before (``_prepare``); the weight export is queued behind the
actor's update on every rank (``_start_sync``), so no round trip separates the two.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import zlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import ray
import torch

from offstep.batch import Sample, TrainBatch, collate
from offstep.config.loader import to_yaml
from offstep.config.schema import Config
from offstep.data.stream import PromptStream
from offstep.models.loading import cache_dir
from offstep.pipeline.advantage import build_kl_controller, compute_advantages
from offstep.pipeline.batching import Generated, assemble, refill_indices
from offstep.pipeline.checkpoints import Checkpoints, check_compatible, complete_checkpoints, load_state
from offstep.pipeline.evaluation import summarise
from offstep.pipeline.inputs import Inputs, prepare_inputs, to_request
from offstep.pipeline.pools import Pool, RoleGroup
from offstep.rollout.types import SamplingParams
from offstep.rollout.worker import RefSpec, RolloutWorker
from offstep.telemetry.console import ConsoleProgress
from offstep.telemetry.loggers import RunLoggers
from offstep.telemetry.progress import LiveStatus
from offstep.telemetry.metrics import Timeline, truncate_jsonl
from offstep.train.actor import ActorWorker
from offstep.train.critic import CriticWorker
from offstep.train.ref import RefWorker


class StalenessError(RuntimeError):
    pass


class RolloutFailed(RuntimeError):
    """Generation could not be completed (rollout workers died or hung too often)."""


class TrainerFailed(RuntimeError):
    """A trainer worker (actor, reference or critic) died."""


@dataclass
class InFlight:
    """A batch whose generation has been launched: its position in the stream, the future of its
    samples, and the future of its :class:`Prepared` batch (the driver's share of the work, done as
    soon as the samples arrive)."""

    batch_idx: int
    epoch: int
    idx: list[int]  # prompt indices into the training set
    fut: asyncio.Future  # -> Generated
    ready: asyncio.Future | None = None  # -> Prepared


class SyncCall(NamedTuple):
    """A weight export in flight: the actor ranks' calls, the rollout workers' receives
    (collective path; ``None``: loads follow the export), and when the export started."""

    export: list
    loads: list | None
    start: float


@dataclass
class Prepared:
    """A generated batch made ready for the trainer while the trainer still updates on the one
    before: collated, its metrics taken and, when they need nothing from the trainer, its
    advantages computed and the batch put in the object store (``ref``)."""

    batch: TrainBatch
    metrics: dict
    ref: ray.ObjectRef | None = None


async def _await(ref):
    return await ref


def _done(result) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_result(result)
    return fut


def check_staleness(versions: torch.Tensor, trainer_version: int, max_staleness: int) -> torch.Tensor:
    """The one place the staleness bound is checked. Returns per-sample staleness."""
    staleness = trainer_version - versions
    if staleness.numel() and (int(staleness.max()) > max_staleness or int(staleness.min()) < 0):
        raise StalenessError(
            f"batch staleness {staleness.min().item()}..{staleness.max().item()} at trainer version "
            f"{trainer_version} breaks pipeline.max_staleness={max_staleness}"
        )
    return staleness


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


class Controller:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.k = cfg.pipeline.max_staleness
        self.out = Path(cfg.trainer.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        progress = cfg.trainer.progress if "console" in cfg.trainer.loggers else "off"
        self.console = ConsoleProgress(cfg.trainer.total_steps, progress, cfg.trainer.status_interval_s)
        self.version = 0  # trainer's policy version: number of updates applied
        self.history: list[dict] = []
        self.checkpoints = Checkpoints(self.out, cfg.trainer.keep_checkpoints)
        self.start_step = 0  # the last step already done (> 0 when resuming)
        self.restored_pending: list = []  # batches that were generating when the checkpoint was written
        self.stop_requested = False  # set by Ctrl-C / SIGTERM: finish this step, checkpoint, stop
        self.restarts = 0  # rollout workers replaced so far
        self.weights_lock = asyncio.Lock()  # held from an update until its weights are exported
        self.queued_sync: SyncCall | None = None  # the export queued behind the last actor update
        self.last_end = 0.0  # when the last trainer stage ended (its worker's clock)

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        cfg = self.cfg
        cfg.algorithm.loss_agg_horizon = cfg.algorithm.loss_agg_horizon or cfg.rollout.max_new_tokens  # Dr. GRPO's constant
        (self.out / "config.yaml").write_text(to_yaml(cfg))
        self.console.log(f"offstep: preparing data and model ({cfg.model.path})")
        self.inputs: Inputs = prepare_inputs(cfg, self.out)
        self.stream = PromptStream(len(self.inputs.train), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
        self.params = SamplingParams(
            n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop),
            greedy_baseline=cfg.algorithm.adv_estimator == "remax",
        )
        self.kl_ctrl = build_kl_controller(cfg.algorithm)  # the KL-in-reward coefficient (state to checkpoint)
        self.val_params = SamplingParams(
            n=cfg.rollout.val_n, temperature=cfg.rollout.val_temperature, top_p=1.0, top_k=0,
            max_new_tokens=cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop),
        )
        self.resume_from = self.checkpoints.resolve(cfg.trainer.resume)
        self.resume_state = None
        t0 = None
        if self.resume_from is not None:
            check_compatible((self.resume_from / "config.yaml").read_text(), cfg)
            self.resume_state = load_state(self.resume_from)
            self.start_step, t0 = self.resume_state["step"], self.resume_state["t0"]
            for name in ("metrics.jsonl", "timeline.jsonl", "samples.jsonl"):
                truncate_jsonl(self.out / name, self.start_step)
        resumed = self.resume_state is not None
        self.loggers = RunLoggers(self.out, cfg, append=resumed)
        self.timeline = Timeline(self.out / "timeline.jsonl", t0=t0, append=resumed)
        self._start_workers()
        if resumed:
            self._restore()

    def _start_workers(self) -> None:
        cfg, res, ro = self.cfg, self.cfg.resources, self.cfg.rollout
        self.console.log("offstep: starting Ray and the worker pools")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            kwargs = dict(include_dashboard=False, log_to_driver=True, logging_level="WARNING")
            if res.ray_address:
                ray.init(address=res.ray_address, **kwargs)
            else:
                ray.init(num_cpus=os.cpu_count(), **kwargs)
        colocate = cfg.pipeline.colocate and self.k == 0
        self.live = LiveStatus.create(self.console)
        self.trainer_pool = Pool.create("trainer", res.trainer_workers, res.cpus_per_trainer_worker, res.gpus_per_trainer_worker)
        self.rollout_pool = None if colocate else Pool.create("rollout", ro.replicas, ro.cpus_per_replica, ro.gpus_per_replica)
        use_ref = cfg.algorithm.needs_reference and not cfg.pipeline.ref_on_rollout
        ref_spec = (
            RefSpec(cfg.model.dtype, cfg.model.compute_dtype, ro.temperature, cfg.actor.micro_batch_size)
            if cfg.algorithm.needs_reference and cfg.pipeline.ref_on_rollout else None
        )
        use_critic = cfg.algorithm.adv_estimator == "gae"
        roles_per_bundle = 1 + use_ref + use_critic + (1 if colocate else 0)
        share = 1.0 / roles_per_bundle
        env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OFFSTEP_CACHE": str(cache_dir())}
        mp, dt, cd, seed, T = self.inputs.model_path, cfg.model.dtype, cfg.model.compute_dtype, cfg.trainer.seed, ro.temperature
        tp = self.trainer_pool
        self.actor = RoleGroup.create("actor", ActorWorker, tp, share, env, seed, mp, dt, cd, cfg.actor, cfg.algorithm, T, self.live.client("trainer"))
        micro, budget = cfg.actor.micro_batch_size, cfg.actor.micro_token_budget
        self.ref = RoleGroup.create("ref", RefWorker, tp, share, env, seed, mp, dt, cd, T, micro, budget) if use_ref else None
        self.critic = (
            RoleGroup.create("critic", CriticWorker, tp, share, env, seed, mp, dt, cd, cfg.critic, cfg.algorithm,
                             micro, cfg.actor.mini_batch_size, budget)
            if use_critic else None
        )
        pool = self.rollout_pool or tp
        rollout_cls = ray.remote(RolloutWorker)

        def make_rollout_worker(i: int):
            opts = pool.options(i % pool.bundles, share if colocate else 1.0, {**env, "OMP_NUM_THREADS": str(pool.cpus_per_bundle)})
            return rollout_cls.options(**opts).remote(
                mp, ro.dtype, pool.device, pool.cpus_per_bundle, self.inputs.reward, cfg.reward.num_threads, ro.max_batch_size,
                ref_spec, self.live.client(f"rollout/{i}"),
            )

        self._make_rollout_worker = make_rollout_worker
        self.rollout = [make_rollout_worker(i) for i in range(ro.replicas)]
        # Fail here, with the worker's own error, rather than at the first step.
        ray.get([w.__ray_ready__.remote() for w in self.rollout] + [h.__ray_ready__.remote() for g in self._groups() for h in g.handles])
        if cfg.pipeline.weight_sync == "collective":  # the actor -> rollout broadcast group, made once
            from offstep.sync.collective import connect

            backend = "nccl" if tp.device == pool.device == "cuda" else "gloo"
            connect(self.actor.handles, self.rollout, backend, cfg.pipeline.weight_sync_bucket_mb,
                    cfg.pipeline.weight_sync_timeout_s, max_in_flight=max(1, self.k))
            self._sync_group = list(self.rollout)  # a replaced worker is not a member: see _sync_weights

    def _groups(self) -> list[RoleGroup]:
        return [g for g in (getattr(self, r, None) for r in ("actor", "ref", "critic")) if g is not None]

    # ---------------------------------------------------------------- rollout
    def _submit_generation(self, prompts, params, seed_base: int, batch_idx: int, uid0: int, with_ref: bool = True):
        reqs = [to_request(p, uid0 + i) for i, p in enumerate(prompts)]
        chunks = split(reqs, len(self.rollout))
        parts = [
            self._generate_on(i, chunk, params, gen_seed(seed_base, batch_idx, i), with_ref)
            for i, chunk in enumerate(chunks) if chunk
        ]
        return asyncio.ensure_future(asyncio.gather(*parts))

    async def _generate_on(self, i: int, chunk, params, seed: int, with_ref: bool):
        """Replica i's share of a generation. A worker that dies, or does not answer within
        ``rollout.timeout_s``, is replaced and the same requests (same seed) are generated again."""
        while True:
            try:
                return await asyncio.wait_for(_await(self.rollout[i].generate.remote(chunk, params, seed, with_ref)),
                                              self.cfg.rollout.timeout_s)
            except asyncio.TimeoutError:
                await self._restart_rollout(i, f"did not finish a generation within rollout.timeout_s={self.cfg.rollout.timeout_s:g}")
            except ray.exceptions.RayActorError as e:
                await self._restart_rollout(i, f"died ({type(e).__name__})")

    async def _restart_rollout(self, i: int, why: str) -> None:
        ro = self.cfg.rollout
        if self.restarts >= ro.max_restarts:
            raise RolloutFailed(
                f"rollout worker {i} {why}, and rollout.max_restarts={ro.max_restarts} restarts are used up; "
                f"see the worker's log above (Ray prints it). Raise rollout.max_restarts or rollout.timeout_s, "
                f"and resume from the last checkpoint with trainer.resume=auto"
            )
        self.restarts += 1
        self.console.log(f"offstep: rollout worker {i} {why}; starting a new one ({self.restarts}/{ro.max_restarts})")
        ray.kill(self.rollout[i], no_restart=True)
        self.rollout[i] = self._make_rollout_worker(i)
        async with self.weights_lock:  # between updates: the exported weights are exactly self.version
            refs = await self.actor.run("export_weights")
            await self.rollout[i].load_weights.remote(refs[0], self.version)

    def _launch(self, batch_idx: int) -> InFlight:
        epoch, idx = self.stream.next_batch()
        return self._in_flight(batch_idx, epoch, idx, asyncio.ensure_future(self._generate_batch(batch_idx, idx)))

    def _in_flight(self, batch_idx: int, epoch: int, idx: list[int], fut: asyncio.Future) -> InFlight:
        cur = InFlight(batch_idx, epoch, idx, fut)
        cur.ready = asyncio.ensure_future(self._prepare(cur))
        return cur

    async def _generate_batch(self, batch_idx: int, idx: list[int]) -> Generated:
        """One batch: its prompts once, or with dynamic sampling, more prompts until enough groups
        have unequal rewards (``offstep/pipeline/batching.py``)."""
        algo, seed, bs = self.cfg.algorithm, self.cfg.trainer.seed, len(idx)
        attempts = algo.dynamic_sampling_max_attempts if algo.dynamic_sampling else 1
        gen = Generated()
        for attempt in range(attempts):
            prompt_idx = idx if attempt == 0 else refill_indices(seed, batch_idx, attempt, len(self.inputs.train), bs)
            uid0 = (batch_idx * attempts + attempt) * bs
            gen.prompt_of.update({uid0 + j: i for j, i in enumerate(prompt_idx)})
            key = batch_idx + attempt * 1_000_003  # attempt 0 keeps the plain run's sampling seeds
            results = await self._submit_generation([self.inputs.train[i] for i in prompt_idx], self.params, seed, key, uid0)
            gen.rounds.append(results)
            gen.samples.extend(s for samples, _ in results for s in samples)
            if not algo.dynamic_sampling:
                return gen
            chosen, gen.kept_groups, gen.filled_groups = assemble(gen.samples, bs)
            if gen.kept_groups == bs:
                break
        gen.samples = chosen
        return gen

    def _record_gen(self, results: list[tuple[list[Sample], dict]], step: int, stage: str = "gen") -> tuple[list[Sample], float, float]:
        """Samples of every replica, in replica order; (samples, generation s, rollout-side ref s).
        Adds the stages to the timeline."""
        samples, span, ref = [], 0.0, 0.0
        for i, (s, t) in enumerate(results):
            samples.extend(s)
            self.timeline.add(f"rollout/{i}", stage, step, t["start"], t["end"], version=t["version"])
            span = max(span, t["end"] - t["start"])
            if "ref_start" in t:
                self.timeline.add(f"rollout/{i}", "ref", step, t["ref_start"], t["ref_end"])
                ref = max(ref, t["ref_end"] - t["ref_start"])
        return samples, span, ref

    # ---------------------------------------------------------------- training
    def _needs_old_logprobs(self, batch: TrainBatch, actor_frozen: bool = False) -> bool:
        """Whether the actor must compute the pre-update log-probs in a pass of their own: the PPO
        ratio needs them for every mini-batch after the first, and the KL penalty in the reward
        before the advantages; otherwise the actor takes them from its own forward pass (one epoch,
        one mini-batch), and in bypass mode the rollout's log-probs are the old policy."""
        cfg, algo = self.cfg, self.cfg.algorithm
        if algo.correction_mode == "bypass":
            return False
        one_pass = cfg.actor.ppo_epochs == 1 and cfg.actor.mini_batch_size in (0, len(batch))
        return algo.use_kl_in_reward or (not one_pass and not actor_frozen)

    async def _prepare(self, cur: InFlight) -> Prepared:
        """The driver's work on a batch, as soon as its samples arrive (for k >= 1 usually while the
        trainer still updates on the batch before): timeline, sample log, collate, metrics and,
        where possible, advantages and the object-store copy. Batch b is trained at step b, by the
        policy of version b - 1 (one update per step), so its staleness is known here too."""
        gen: Generated = await cur.fut
        t0, step, k = time.time(), cur.batch_idx, self.k
        gen_span = ref_span = 0.0
        for attempt, results in enumerate(gen.rounds):
            _, g, r = self._record_gen(results, step, "gen" if attempt == 0 else "gen_more")
            gen_span, ref_span = gen_span + g, ref_span + r
        samples = gen.samples
        self._log_samples(step, samples, gen.prompt_of)
        batch = collate(samples, self.inputs.pad_id)
        staleness = check_staleness(batch.versions, step - 1, k)
        batch.staleness = staleness  # per sample: the actor reports its correction metrics per staleness
        m = self._batch_metrics(step, cur.epoch, samples, batch, staleness)
        m["data/prompts_crc32"] = zlib.crc32(",".join(map(str, cur.idx)).encode())
        if self.cfg.algorithm.dynamic_sampling:
            m["rollout/dynamic_sampling_attempts"] = len(gen.rounds)
            m["rollout/dynamic_sampling_filled_groups"] = gen.filled_groups
        m["timing_s/gen"] = gen_span
        if ref_span:
            m["timing_s/ref_rollout"] = ref_span
        m["perf/gen_tokens_per_s"] = float(batch.response_mask.sum()) / max(gen_span, 1e-9)
        ready = Prepared(batch, m)
        if self.ref is None and self.critic is None and not self._needs_old_logprobs(batch):
            ready.ref = self._advantages_and_put(batch, m)  # nothing needed from the trainer
        self.timeline.add("driver", "prepare", step, t0, time.time())
        return ready

    def _advantages_and_put(self, batch: TrainBatch, m: dict) -> ray.ObjectRef:
        algo = self.cfg.algorithm
        if algo.correction_mode == "bypass":  # the rollout's log-probs are the old policy: no forward pass
            batch.old_logprobs = batch.rollout_logprobs
        t0 = time.time()
        m.update(compute_advantages(batch, algo, self.kl_ctrl, self.cfg.rollout.max_new_tokens))
        m["timing_s/adv"] = time.time() - t0
        return ray.put(batch)  # one copy in the object store, read by every rank

    async def _timed(self, group: RoleGroup, method: str, stage: str, step: int, *args, then=None):
        """Run ``method`` on every rank of ``group``; ``then()`` (if given) submits the calls that
        follow it, so that each rank starts them as soon as this one ends, without a round trip."""
        self.live.note("trainer", stage, step=step)
        refs = group.submit(method, *args)
        if then is not None:
            then()
        result, t = (await asyncio.gather(*refs))[0]
        self.timeline.add("trainer", stage, step, t["start"], t["end"])
        self.last_end = t["end"]
        return result, t["end"] - t["start"]

    async def _train(self, ready: Prepared, step: int, m: dict) -> None:
        cfg, batch = self.cfg, ready.batch
        # Critic warm-up: only the critic trains during the first critic.warmup_steps steps.
        actor_frozen = self.critic is not None and step <= cfg.critic.warmup_steps
        batch_ref = ready.ref if ready.ref is not None else await self._trainer_inputs(batch, step, m, actor_frozen)
        if self.critic is not None:
            cm, m["timing_s/update_critic"] = await self._timed(self.critic, "update", "update_critic", step, batch_ref)
            m.update({f"critic/{k}": v for k, v in cm.items()})
            m["actor/frozen"] = float(actor_frozen)
        if not actor_frozen:
            # The new weights' export is queued behind the update on every rank: it starts as the update ends.
            am, m["timing_s/update_actor"] = await self._timed(self.actor, "update", "update_actor", step, batch_ref,
                                                               then=self._queue_sync)
            self.queued_sync = self.queued_sync._replace(start=self.last_end)
            m.update({f"actor/{k}": v for k, v in am.items()})

    async def _trainer_inputs(self, batch: TrainBatch, step: int, m: dict, actor_frozen: bool) -> ray.ObjectRef:
        """The passes over the batch that the advantages need from the trainer workers (reference,
        critic values, pre-update log-probs), then the advantages; returns the batch's object-store ref."""
        if self.ref is not None:
            batch.ref_logprobs, m["timing_s/ref"] = await self._timed(self.ref, "compute_logprobs", "ref", step, batch)
        if self.critic is not None:
            batch.values, m["timing_s/values"] = await self._timed(self.critic, "compute_values", "values", step, batch)
        if self._needs_old_logprobs(batch, actor_frozen):
            batch.old_logprobs, m["timing_s/old_logprobs"] = await self._timed(self.actor, "compute_logprobs", "old_logprobs", step, batch)
        return self._advantages_and_put(batch, m)

    def _start_sync(self, version: int) -> SyncCall:
        """Submit the export of the actor's weights as ``version`` (queued behind whatever the actor
        ranks are running) and, on the collective path, the receives on every rollout worker."""
        # Once a rollout worker has been replaced, the group has a dead member: the object store takes over.
        if self.cfg.pipeline.weight_sync == "collective" and self.rollout == getattr(self, "_sync_group", None):
            # Receives first: each queues behind its worker's generation in flight. Actor rank 0
            # posts its broadcasts and returns (with NCCL it waits for every receiver).
            loads = [w.receive_weights.remote(version) for w in self.rollout]
            return SyncCall(self.actor.submit("send_weights", version), loads, time.time())
        return SyncCall(self.actor.submit("export_weights"), None, time.time())

    def _queue_sync(self) -> None:
        """Queue the next version's export behind the actor update just submitted."""
        self.queued_sync = self._start_sync(self.version + 1)

    async def _sync_weights(self, step: int) -> tuple[float, asyncio.Future]:
        """Finish the export of the actor's weights (started behind the update, or now) and queue
        their load on every rollout worker; returns the export's seconds and the loads' future."""
        self.live.note("trainer", "sync", step=step)
        call, self.queued_sync = self.queued_sync or self._start_sync(self.version), None
        exported = (await asyncio.gather(*call.export))[0]
        loads = call.loads
        if loads is None:  # object store: every rollout worker reads the same copy
            loads = [w.load_weights.remote(exported[0], self.version) for w in self.rollout]
        t1 = time.time()
        self.timeline.add("trainer", "sync_export", step, call.start, t1)
        return t1 - call.start, asyncio.ensure_future(asyncio.gather(*loads))

    # ---------------------------------------------------------------- validation
    def _start_validation(self, step: int):
        if not self.inputs.val:
            return None
        return self._submit_generation(self.inputs.val, self.val_params, self.cfg.trainer.seed + 1, 0, 10**9, False)

    async def _finish_validation(self, fut, step: int) -> dict:
        samples, _, _ = self._record_gen(await fut, step, stage="val")
        return {**summarise(samples), "val/policy_version": samples[0].version}

    # ---------------------------------------------------------------- the loop
    async def fit(self) -> list[dict]:
        cfg, k, N = self.cfg, self.k, self.cfg.trainer.total_steps
        self._install_signal_handlers()
        self.live.start()
        if self.start_step:  # resumed: the rollout workers get the restored policy first
            _, loads = await self._sync_weights(self.start_step)
            await loads
        elif cfg.trainer.val_before_train and self.inputs.val:
            vm = await self._finish_validation(self._start_validation(0), 0)
            self._emit({"step": 0, "policy_version": 0, **vm})
        # Batches already launched when the checkpoint was written come back as they were.
        pending: deque[InFlight] = deque(
            self._in_flight(b, e, idx, _done(results)) for b, e, idx, results in self.restored_pending
        )
        finishing: asyncio.Future | None = None
        launched = self.start_step + len(pending)
        t_step = time.time()
        for step in range(self.start_step + 1, N + 1):
            # Keep k batches generating ahead of the one this step consumes.
            while len(pending) <= k and launched < N:
                launched += 1
                pending.append(self._launch(launched))
            cur = pending.popleft()
            assert cur.batch_idx == step and self.version == step - 1, "batch b is trained at step b by policy b - 1"
            t_wait = time.time()
            self.live.note("trainer", "wait_gen", step=step)
            ready: Prepared = await cur.ready
            wait = time.time() - t_wait
            self.timeline.add("trainer", "wait_gen", step, t_wait, time.time())
            batch, m = ready.batch, ready.metrics
            m["timing_s/wait_gen"] = wait
            async with self.weights_lock:
                await self._train(ready, step, m)
                self.version += 1
                export_s, loads = await self._sync_weights(step)
            val = None
            if step == N or (cfg.trainer.val_freq and step % cfg.trainer.val_freq == 0):
                val = self._start_validation(step)
            now = time.time()
            m["timing_s/step"] = now - t_step
            t_step = now
            m["perf/tokens_per_s"] = float(batch.attention_mask.sum()) / m["timing_s/step"]
            m["perf/samples_per_s"] = len(batch) / m["timing_s/step"]
            m["policy_version"] = self.version
            finishing = asyncio.ensure_future(self._finish_step(m, export_s, loads, val, finishing))
            save_freq = cfg.trainer.save_freq
            if save_freq and (step % save_freq == 0 or step == N or self.stop_requested):
                await self._save_checkpoint(step, pending, finishing)
                t_step = time.time()  # a save is not part of the next step's time
            if self.stop_requested:
                self.console.log(f"offstep: stopped after step {step}" + ("" if save_freq else
                                 " (no checkpoint: trainer.save_freq=0)"))
                break
        if finishing is not None:
            await finishing
        await self.live.stop()
        return self.history

    # ---------------------------------------------------------------- checkpoints
    async def _save_checkpoint(self, step: int, pending: deque, finishing) -> None:
        """Write the checkpoint of ``step``: trainer roles' shards, the prompt stream, and the
        batches generating ahead, whose samples are awaited and stored so that a resumed run
        trains on exactly them (neither lost nor generated twice)."""
        t0 = time.time()
        self.console.status(f"step {step}: writing checkpoint")
        await finishing  # this step's metrics are on disk before the checkpoint that covers them
        in_flight = [(b.batch_idx, b.epoch, b.idx, await b.fut) for b in pending]
        staging = self.checkpoints.staging(step)
        await asyncio.gather(*(g.run("save_checkpoint", str(staging / g.name)) for g in (self.actor, self.critic) if g))
        state = {
            "step": step, "version": self.version, "t0": self.timeline.t0, "stream": self.stream.state_dict(),
            "in_flight": in_flight, "restarts": self.restarts,
        }
        if getattr(self, "kl_ctrl", None) is not None:
            state["kl_ctrl"] = self.kl_ctrl.state_dict()
        path = self.checkpoints.commit(staging, step, state, to_yaml(self.cfg))
        self.timeline.add("trainer", "checkpoint", step, t0, time.time())
        self.console.log(f"offstep: checkpoint {path} ({time.time() - t0:.1f} s)")

    def _restore(self) -> None:
        st = self.resume_state
        ray.get([h for g in (self.actor, self.critic) if g for h in g.submit("load_checkpoint", str(self.resume_from / g.name))])
        self.version, self.restarts = st["version"], st["restarts"]
        self.stream.load_state_dict(st["stream"])
        if "kl_ctrl" in st and getattr(self, "kl_ctrl", None) is not None:
            self.kl_ctrl.load_state_dict(st["kl_ctrl"])
        self.restored_pending = st["in_flight"]
        self.console.log(f"offstep: resumed from {self.resume_from} (step {self.start_step}, policy version {self.version})")

    def _install_signal_handlers(self) -> None:
        """Ctrl-C or SIGTERM: finish the current step, write a checkpoint (when trainer.save_freq
        > 0) and stop. A second Ctrl-C stops at once."""
        loop = asyncio.get_running_loop()

        def request_stop(sig: signal.Signals) -> None:
            if self.stop_requested:
                return
            self.stop_requested = True
            loop.remove_signal_handler(signal.SIGINT)  # the next Ctrl-C raises KeyboardInterrupt
            self.console.log(f"offstep: {sig.name} received; stopping after this step (Ctrl-C again to abort)")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, request_stop, sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass

    async def _finish_step(self, m: dict, export_s: float, loads, val, previous) -> None:
        """Complete a step's record once its weight sync (and validation) are done; records are
        emitted in step order because each waits for the previous step's first."""
        if previous is not None:
            await previous
        try:
            timings = await loads
        except ray.exceptions.RayActorError:  # that worker is replaced, with these weights, when next used
            timings = []
        for i, t in enumerate(timings):
            self.timeline.add(f"rollout/{i}", "load_weights", m["step"], t["start"], t["end"], version=t["version"])
        m["timing_s/sync_weights"] = export_s + max((t["end"] - t["start"] for t in timings), default=0.0)
        if val is not None:
            m.update(await self._finish_validation(val, m["step"]))
        self._emit(m)

    def _emit(self, m: dict) -> None:
        self.history.append(m)
        self.loggers.log(m)
        self.console.step(m)

    def _log_samples(self, step: int, samples: list[Sample], prompt_of: dict[int, int]) -> None:
        t = self.cfg.trainer
        if not t.log_samples_freq or (step != 1 and step % t.log_samples_freq):
            return
        rows = [
            {"step": step, "version": s.version, "data_source": s.data_source,
             "prompt": self.inputs.train[prompt_of[s.uid]].record.messages[-1]["content"], "response": s.text,
             "reward": s.score, "finish_reason": s.finish_reason}
            for s in samples[:: max(1, len(samples) // t.log_samples_count)][: t.log_samples_count]
        ]
        self.loggers.log_samples(step, rows)

    def _batch_metrics(self, step, epoch, samples, batch: TrainBatch, staleness) -> dict:
        lengths = batch.response_mask.sum(-1)
        return {
            "step": step,
            "epoch": epoch,
            "rollout/staleness_max": int(staleness.max()),
            "rollout/staleness_mean": float(staleness.float().mean()),
            "rollout/version_min": int(batch.versions.min()),
            "reward/mean": float(batch.scores.mean()),
            "reward/max": float(batch.scores.max()),
            "reward/min": float(batch.scores.min()),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/clip_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
        }

    def close(self) -> None:
        for g in self._groups():
            try:
                ray.get(g.submit("shutdown"), timeout=30)
            except Exception:
                pass
        self.console.close()
        if getattr(self, "live", None) is not None:
            self.live.close()
        for w in ("loggers", "timeline"):
            if getattr(self, w, None) is not None:
                getattr(self, w).close()
        for g in self._groups():
            g.kill()
        for w in getattr(self, "rollout", []):
            ray.kill(w)
        for p in (getattr(self, "trainer_pool", None), getattr(self, "rollout_pool", None)):
            if p is not None:
                p.remove()
        if getattr(self, "_owns_ray", False):
            ray.shutdown()


def train(cfg: Config) -> list[dict]:
    """Validate, set up, run the loop, clean up. Returns the per-step metrics."""
    from offstep.config.validate import validate

    validate(cfg)
    ctl = Controller(cfg)
    try:
        ctl.setup()
        return asyncio.run(ctl.fit())
    except ray.exceptions.RayActorError as e:
        found = complete_checkpoints(ctl.checkpoints.root)
        last = f"the last checkpoint, {found[-1][1]}, is intact: continue with trainer.resume=auto" if found else (
            "no checkpoint was written (set trainer.save_freq to write them)")
        raise TrainerFailed(f"a trainer worker died ({type(e).__name__}: {str(e).splitlines()[0]}); {last}") from e
    finally:
        ctl.close()
