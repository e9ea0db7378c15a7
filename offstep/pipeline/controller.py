"""The controller: one asyncio loop that owns the order of generation, training and weight sync.

With ``pipeline.max_staleness = k`` generation runs up to k batches ahead of training:

    k = 1   rollout: [gen b1 @v0][gen b2 @v0 ][gen b3 @v1 ][gen b4 @v2 ]...
            trainer:             [train b1 → v1]sync[train b2 → v2]sync...

k = 0 is the synchronous loop. Every sample carries the policy version that generated it (the
rollout worker tags it); ``check_staleness`` is the one place the bound is enforced.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from pathlib import Path

import ray
import torch

from offstep.batch import Sample, TrainBatch, collate
from offstep.config.loader import to_yaml
from offstep.config.schema import Config
from offstep.data.stream import PromptStream
from offstep.models.loading import cache_dir
from offstep.pipeline.advantage import compute_advantages
from offstep.pipeline.evaluation import summarise
from offstep.pipeline.inputs import Inputs, prepare_inputs, to_request
from offstep.pipeline.pools import Pool, RoleGroup
from offstep.rollout.types import SamplingParams
from offstep.rollout.worker import RefSpec, RolloutWorker
from offstep.telemetry.console import ConsoleProgress
from offstep.telemetry.loggers import SampleLog, TensorBoardLogger
from offstep.telemetry.metrics import JsonlWriter, Timeline
from offstep.train.actor import ActorWorker
from offstep.train.critic import CriticWorker
from offstep.train.ref import RefWorker


class StalenessError(RuntimeError):
    pass


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
        self.console = ConsoleProgress(cfg.trainer.total_steps, progress)
        self.version = 0  # trainer's policy version: number of updates applied
        self.history: list[dict] = []

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        cfg = self.cfg
        (self.out / "config.yaml").write_text(to_yaml(cfg))
        self.console.log(f"offstep: preparing data and model ({cfg.model.path})")
        self.inputs: Inputs = prepare_inputs(cfg, self.out)
        self.stream = PromptStream(len(self.inputs.train), cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle)
        self.params = SamplingParams(
            n=cfg.rollout.n, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k, max_new_tokens=cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop),
        )
        self.val_params = SamplingParams(
            n=cfg.rollout.val_n, temperature=cfg.rollout.val_temperature, top_p=1.0, top_k=0,
            max_new_tokens=cfg.rollout.max_new_tokens, stop=tuple(cfg.rollout.stop),
        )
        self.metrics = JsonlWriter(self.out / "metrics.jsonl")
        self.samples_log = SampleLog(self.out / "samples.jsonl")
        self.tensorboard = TensorBoardLogger(self.out) if "tensorboard" in cfg.trainer.loggers else None
        self.timeline = Timeline(self.out / "timeline.jsonl")
        self._start_workers()

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
        self.trainer_pool = Pool.create("trainer", res.trainer_workers, res.cpus_per_trainer_worker, res.gpus_per_trainer_worker)
        self.rollout_pool = None if colocate else Pool.create("rollout", ro.replicas, ro.cpus_per_replica, ro.gpus_per_replica)
        use_ref = cfg.algorithm.use_kl_loss and not cfg.pipeline.ref_on_rollout
        ref_spec = (
            RefSpec(cfg.model.dtype, cfg.model.compute_dtype, ro.temperature, cfg.actor.micro_batch_size)
            if cfg.algorithm.use_kl_loss and cfg.pipeline.ref_on_rollout else None
        )
        use_critic = cfg.algorithm.adv_estimator == "gae"
        roles_per_bundle = 1 + use_ref + use_critic + (1 if colocate else 0)
        share = 1.0 / roles_per_bundle
        env = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OFFSTEP_CACHE": str(cache_dir())}
        mp, dt, cd, seed, T = self.inputs.model_path, cfg.model.dtype, cfg.model.compute_dtype, cfg.trainer.seed, ro.temperature
        tp = self.trainer_pool
        self.actor = RoleGroup.create("actor", ActorWorker, tp, share, env, seed, mp, dt, cd, cfg.actor, cfg.algorithm, T)
        self.ref = RoleGroup.create("ref", RefWorker, tp, share, env, seed, mp, dt, cd, T, cfg.actor.micro_batch_size) if use_ref else None
        self.critic = (
            RoleGroup.create("critic", CriticWorker, tp, share, env, seed, mp, dt, cd, cfg.critic, cfg.algorithm,
                             cfg.actor.micro_batch_size, cfg.actor.mini_batch_size)
            if use_critic else None
        )
        pool = self.rollout_pool or tp
        rollout_cls = ray.remote(RolloutWorker)
        self.rollout = []
        for i in range(ro.replicas):
            b = i % pool.bundles
            opts = pool.options(b, share if colocate else 1.0, {**env, "OMP_NUM_THREADS": str(pool.cpus_per_bundle)})
            self.rollout.append(
                rollout_cls.options(name=f"rollout-{i}", **opts).remote(
                    mp, ro.dtype, pool.device, pool.cpus_per_bundle, self.inputs.reward, cfg.reward.num_threads, ro.max_batch_size,
                    ref_spec,
                )
            )
        # Fail here, with the worker's own error, rather than at the first step.
        ray.get([w.__ray_ready__.remote() for w in self.rollout] + [h.__ray_ready__.remote() for g in self._groups() for h in g.handles])

    def _groups(self) -> list[RoleGroup]:
        return [g for g in (getattr(self, r, None) for r in ("actor", "ref", "critic")) if g is not None]

    # ---------------------------------------------------------------- rollout
    def _submit_generation(self, prompts, params, seed_base: int, batch_idx: int, uid0: int, with_ref: bool = True):
        reqs = [to_request(p, uid0 + i) for i, p in enumerate(prompts)]
        chunks = split(reqs, len(self.rollout))
        refs = [
            w.generate.remote(chunk, params, gen_seed(seed_base, batch_idx, i), with_ref)
            for i, (w, chunk) in enumerate(zip(self.rollout, chunks)) if chunk
        ]
        return asyncio.ensure_future(asyncio.gather(*refs))

    def _launch(self, batch_idx: int):
        epoch, idx = self.stream.next_batch()
        prompts = [self.inputs.train[i] for i in idx]
        fut = self._submit_generation(prompts, self.params, self.cfg.trainer.seed, batch_idx, batch_idx * len(idx))
        return batch_idx, epoch, prompts, fut

    def _record_gen(self, results: list[tuple[list[Sample], dict]], step: int, stage: str = "gen") -> tuple[list[Sample], float, float]:
        """Samples of every replica, in replica order; (samples, generation s, rollout-side ref s)."""
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
    async def _timed(self, group: RoleGroup, method: str, stage: str, step: int, *args):
        result, t = await group.run(method, *args)
        self.timeline.add("trainer", stage, step, t["start"], t["end"])
        return result, t["end"] - t["start"]

    async def _train(self, batch: TrainBatch, step: int, m: dict) -> None:
        cfg, algo = self.cfg, self.cfg.algorithm
        if self.ref is not None:
            batch.ref_logprobs, m["timing_s/ref"] = await self._timed(self.ref, "compute_logprobs", "ref", step, batch)
        if self.critic is not None:
            batch.values, m["timing_s/values"] = await self._timed(self.critic, "compute_values", "values", step, batch)
        one_pass = cfg.actor.ppo_epochs == 1 and cfg.actor.mini_batch_size in (0, len(batch))
        if not one_pass:  # the PPO ratio needs the pre-update policy's log-probs for every mini-batch
            batch.old_logprobs, m["timing_s/old_logprobs"] = await self._timed(self.actor, "compute_logprobs", "old_logprobs", step, batch)
        t0 = time.time()
        m.update(compute_advantages(batch, algo))
        m["timing_s/adv"] = time.time() - t0
        batch_ref = ray.put(batch)  # one copy in the object store, read by every rank
        if self.critic is not None:
            cm, m["timing_s/update_critic"] = await self._timed(self.critic, "update", "update_critic", step, batch_ref)
            m.update({f"critic/{k}": v for k, v in cm.items()})
        am, m["timing_s/update_actor"] = await self._timed(self.actor, "update", "update_actor", step, batch_ref)
        m.update({f"actor/{k}": v for k, v in am.items()})

    async def _sync_weights(self, step: int) -> tuple[float, asyncio.Future]:
        """Export the actor's weights once and queue their load on every rollout worker."""
        t0 = time.time()
        refs = await self.actor.run("export_weights")
        t1 = time.time()
        self.timeline.add("trainer", "sync_export", step, t0, t1)
        loads = [w.load_weights.remote(refs[0], self.version) for w in self.rollout]
        return t1 - t0, asyncio.ensure_future(asyncio.gather(*loads))

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
        if cfg.trainer.val_before_train and self.inputs.val:
            vm = await self._finish_validation(self._start_validation(0), 0)
            self._emit({"step": 0, "policy_version": 0, **vm})
        pending: deque = deque()
        finishing: asyncio.Future | None = None
        launched = 0
        t_step = time.time()
        for step in range(1, N + 1):
            # Keep k batches generating ahead of the one this step consumes.
            while len(pending) <= k and launched < N:
                launched += 1
                pending.append(self._launch(launched))
            batch_idx, epoch, prompts, fut = pending.popleft()
            t_wait = time.time()
            self.console.status(f"step {step}: waiting for generation")
            results = await fut
            wait = time.time() - t_wait
            self.timeline.add("trainer", "wait_gen", step, t_wait, time.time())
            samples, gen_span, ref_span = self._record_gen(results, step)
            self._log_samples(step, samples, prompts, batch_idx * len(prompts))
            batch = collate(samples, self.inputs.pad_id)
            staleness = check_staleness(batch.versions, self.version, k)
            m = self._batch_metrics(step, epoch, samples, batch, staleness)
            m["timing_s/gen"], m["timing_s/wait_gen"] = gen_span, wait
            if ref_span:
                m["timing_s/ref_rollout"] = ref_span
            m["perf/gen_tokens_per_s"] = float(batch.response_mask.sum()) / max(gen_span, 1e-9)
            self.console.status(f"step {step}: training")
            await self._train(batch, step, m)
            self.version += 1
            export_s, loads = await self._sync_weights(step)
            val = None
            if step == N or (cfg.trainer.val_freq and step % cfg.trainer.val_freq == 0):
                val = self._start_validation(step)
            now = time.time()
            m["timing_s/step"] = now - t_step
            t_step = now
            m["perf/tokens_per_s"] = float(batch.attention_mask.sum()) / m["timing_s/step"]
            m["policy_version"] = self.version
            finishing = asyncio.ensure_future(self._finish_step(m, export_s, loads, val, finishing))
        if finishing is not None:
            await finishing
        return self.history

    async def _finish_step(self, m: dict, export_s: float, loads, val, previous) -> None:
        """Complete a step's record once its weight sync (and validation) are done; records are
        emitted in step order because each waits for the previous step's first."""
        if previous is not None:
            await previous
        timings = await loads
        for i, t in enumerate(timings):
            self.timeline.add(f"rollout/{i}", "load_weights", m["step"], t["start"], t["end"], version=t["version"])
        m["timing_s/sync_weights"] = export_s + max(t["end"] - t["start"] for t in timings)
        if val is not None:
            m.update(await self._finish_validation(val, m["step"]))
        self._emit(m)

    def _emit(self, m: dict) -> None:
        self.history.append(m)
        self.metrics.write(m)
        if self.tensorboard is not None:
            self.tensorboard.log(m)
        self.console.step(m)

    def _log_samples(self, step: int, samples: list[Sample], prompts, uid0: int) -> None:
        t = self.cfg.trainer
        if not t.log_samples_freq or (step != 1 and step % t.log_samples_freq):
            return
        rows = [
            {"step": step, "version": s.version, "data_source": s.data_source,
             "prompt": prompts[s.uid - uid0].record.messages[-1]["content"], "response": s.text,
             "reward": s.score, "finish_reason": s.finish_reason}
            for s in samples[:: max(1, len(samples) // t.log_samples_count)][: t.log_samples_count]
        ]
        self.samples_log.write(rows)
        if self.tensorboard is not None:
            self.tensorboard.log_samples(step, rows)

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
        for w in ("metrics", "timeline", "samples_log", "tensorboard"):
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
    finally:
        ctl.close()
