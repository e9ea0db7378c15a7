"""Simulated workers for the real controller loop: Ray actors with the real workers' method names
and results that sleep for set durations instead of running a model. The loop receives them as
its :class:`~offstep.pipeline.workers.Workers` (``train(cfg, start=fake_workers(...))``).

* ``FakeRollout.generate`` -> ``(samples, GenTiming)``: ``rollout.n`` scored ``Sample`` s per
  request, a few random tokens each, tagged with the replica's policy version, after ``gen_s``;
  ``load_weights`` takes ``load_s``, sets the version and reports the digest of its one "weight"
  (the actor's update count, as exported);
* ``FakeActor.update`` / ``compute_logprobs`` -> ``(result, Span)`` after ``train_s`` (plus
  ``train_s_per_token`` per real token of the batch, when set); ``export_weights`` ->
  ``[ObjectRef, digest]`` after ``export_s``; ``save_checkpoint`` / ``load_checkpoint`` write and
  read a real (one-number) role checkpoint holding the update count.

The replicas' GPU-like profile and their fully asynchronous mode are simulated in
``tests/fakes_stream.py``.

Like the real workers, they push their progress to the live-status hub. Used by
``tests/pipeline/test_controller_sim.py``, ``tests/pipeline/test_fully_async_sim.py``,
``benchmarks/controller_overhead.py`` and ``benchmarks/async_sim.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import deque
from pathlib import Path

import ray
import torch

from offstep.batch import GenTiming, Sample, Span
from offstep.config.schema import Config
from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.pipeline.pools import RoleGroup
from offstep.pipeline.workers import Workers
from offstep.sync.collective import TensorSpec
from offstep.sync.digest import Loaded, digest
from offstep.telemetry.names import Role, Stage, replica
from offstep.telemetry.progress import LiveStatus, ProgressClient

if __package__:  # imported as tests.fakes (the benchmarks, run as python -m benchmarks.NAME from the checkout's root)
    from .fakes_stream import TOKEN0, GpuProfile, SimStream, logprob
else:  # imported as fakes, from beside this file (the tests)
    from fakes_stream import TOKEN0, GpuProfile, SimStream, logprob  # noqa: E402

# Imported by path or as a test helper: Ray ships these classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FakeRollout:
    def __init__(self, gen_s: float, load_s: float, progress: ProgressClient, profile: GpuProfile | None = None):
        self.gen_s, self.load_s, self.version, self.progress = gen_s, load_s, 0, progress
        self.profile = profile
        self._stream: SimStream | None = None

    def generate(self, requests, params, seed: int, with_ref: bool = True):
        t0 = time.time()
        self.progress.start(Stage.GEN, len(requests) * params.n, version=self.version)
        if self.profile is not None:
            return self._generate_profiled(requests, params, seed, t0)
        g = torch.Generator().manual_seed(seed)
        samples = []
        for r in requests:
            for _ in range(params.n):
                n_tok = int(torch.randint(4, 17, (1,), generator=g))
                samples.append(
                    Sample(
                        uid=r.uid,
                        prompt_ids=list(r.prompt_ids),
                        response_ids=torch.randint(3, 200, (n_tok,), generator=g).tolist(),
                        rollout_logprobs=(-torch.rand(n_tok, generator=g)).tolist(),
                        finish_reason="stop",
                        score=float(torch.randint(0, 2, (1,), generator=g)),
                        version=self.version,
                        data_source=r.data_source,
                    )
                )
        time.sleep(max(0.0, self.gen_s - (time.time() - t0)))
        self.progress.advance(len(samples))
        return samples, GenTiming(Span(t0, time.time(), self.version))

    def _generate_profiled(self, requests, params, seed: int, t0: float):
        """Batch mode on the GPU-like profile: the call's samples (request i's sample j has stream
        ``i * n + j``, as the real engine's) through continuous batching; the call lasts as many
        decode steps as the schedule needs (the longest sample sets it when all fit the slots)."""
        p = self.profile
        drawn = [
            p.length(seed, i * params.n + j, params.max_new_tokens)
            for i in range(len(requests))
            for j in range(params.n)
        ]
        waiting, running, steps = deque(n for n, _ in drawn), [], 0
        while waiting or running:
            while waiting and len(running) < p.slots:
                running.append(waiting.popleft())
            steps += 1
            running = [n - 1 for n in running if n > 1]
        time.sleep(max(0.0, steps * p.step_s - (time.time() - t0)))
        samples = []
        for k, (n, score) in enumerate(drawn):
            r = requests[k // params.n]
            samples.append(
                Sample(
                    uid=r.uid,
                    prompt_ids=list(r.prompt_ids),
                    response_ids=[TOKEN0 + self.version] * n,
                    rollout_logprobs=[logprob(i + 1) for i in range(n)],
                    finish_reason="length" if n >= params.max_new_tokens else "stop",
                    score=score,
                    version=self.version,
                    data_source=r.data_source,
                )
            )
        self.progress.advance(len(samples))
        return samples, GenTiming(Span(t0, time.time(), self.version))

    def reset(self, gen_s: float, load_s: float, profile: GpuProfile | None) -> None:
        """A fresh replica of these settings (:class:`FakePool`: one actor for many runs)."""
        if self._stream is not None:
            self._stream.close()
        self.__init__(gen_s, load_s, self.progress, profile)

    # The fully asynchronous mode (the real worker's methods; see the module's docstring).
    def stream_start(
        self, prompts: list[list[int]], params, partial: str, replay: list | None = None, max_kv_age: int = -1
    ) -> None:
        if replay is not None:
            raise ValueError("FakeRollout does not replay a schedule (it has no decode steps)")
        if self.profile is None:
            raise ValueError("FakeRollout streams only with a GpuProfile")
        self.progress.start(Stage.GEN, total=0, version=self.version)
        self._stream = SimStream(self, params, partial)

    def stream_submit(self, groups: list) -> None:
        self._stream.submit(groups)

    def stream_take(self, wait_s: float) -> list:
        return self._stream.take(wait_s)

    def stream_suspend(self) -> list:
        return self._stream.suspend()

    def stream_schedule(self) -> list:
        return []  # no decode steps to record

    def weight_sync_manifest(self) -> list:
        return [TensorSpec("w", (1,), "float32")]

    def load_weights(self, packed, version: int) -> Loaded:
        t0 = time.time()
        self.progress.start(Stage.LOAD_WEIGHTS, version=version)
        if self._stream is not None:  # lands between two decode steps of the running stream
            self._stream.post_load(version)
        else:
            time.sleep(self.load_s)
            self.version = version
        held = torch.tensor([float(packed["version"])])  # the one "weight" the actor sent
        return Loaded(Span(t0, time.time(), version), digest([("w", held)]), 0.0)


class FakeActor:
    """``record``: a JSON-lines file that gets one line per update: the trainer's version before
    it, and per sample its group uid, ``Sample.version``, the oldest version among its response
    tokens (read from the token ids, see ``TOKEN0``), its length, its score and its prompt's tokens."""

    def __init__(
        self,
        train_s: float,
        export_s: float,
        progress: ProgressClient,
        train_s_per_token: float = 0.0,
        record: str | None = None,
    ):
        self.train_s, self.export_s, self.updates, self.progress = train_s, export_s, 0, progress
        self.train_s_per_token, self.record = train_s_per_token, record

    def reset(self, train_s: float, export_s: float, train_s_per_token: float = 0.0, record: str | None = None) -> None:
        self.__init__(train_s, export_s, self.progress, train_s_per_token, record)

    def _sleep(self, s: float) -> Span:
        t0 = time.time()
        time.sleep(s)
        return Span(t0, time.time())

    def _work_s(self, batch) -> float:
        return self.train_s + self.train_s_per_token * float(batch.attention_mask.sum())

    def update(self, batch) -> tuple[dict, Span]:
        self.progress.start(Stage.UPDATE_ACTOR, 1)
        if self.record:
            self._record(batch)
        span = self._sleep(self._work_s(batch))
        self.progress.advance()
        self.updates += 1
        return {"pg_loss": 0.0, "grad_norm": 1.0, "entropy": 1.0, "lr": 1e-6, "skipped_steps": 0.0}, span

    def _record(self, batch) -> None:
        P, rows = batch.prompt_len, []
        for i in range(len(batch)):
            resp = batch.input_ids[i, P:][batch.response_mask[i] > 0]
            rows.append(
                {
                    "uid": int(batch.group_ids[i]),
                    "version": int(batch.versions[i]),
                    "oldest": int(resp.min()) - TOKEN0 if len(resp) else None,
                    "length": len(resp),
                    "score": float(batch.scores[i]),
                    "prompt": batch.input_ids[i, :P][batch.attention_mask[i, :P] > 0].tolist(),
                }
            )
        with open(self.record, "a") as f:
            f.write(json.dumps({"trainer_version": self.updates, "samples": rows}) + "\n")

    def compute_logprobs(self, batch) -> tuple[torch.Tensor, Span]:
        return torch.zeros_like(batch.rollout_logprobs), self._sleep(self._work_s(batch))

    def set_sync_manifest(self, specs: list, full_every: int = 0) -> None:
        pass

    def export_weights(self, full: bool = False) -> list:
        time.sleep(self.export_s)
        return [ray.put({"version": self.updates}), digest([("w", torch.tensor([float(self.updates)]))])]

    # A real role checkpoint (DCP shards and rank0.json) of a one-number model: the update count.
    def save_checkpoint(self, path: str) -> None:
        from offstep.train.checkpoint import save_role

        save_role(path, 0, torch.nn.Linear(1, 1, bias=False), extra={"updates": self.updates})

    def load_checkpoint(self, path: str) -> None:
        from offstep.train.checkpoint import load_role

        self.updates = int(load_role(path, 0, torch.nn.Linear(1, 1, bias=False))["updates"])

    def shutdown(self) -> None:
        pass


def fake_workers(
    gen_s: float,
    train_s: float,
    export_s: float,
    load_s: float,
    profile: GpuProfile | None = None,
    train_s_per_token: float = 0.0,
    record: str | None = None,
):
    """A ``start(cfg, inputs, console) -> Workers`` for the loop: one simulated actor rank and
    ``rollout.replicas`` simulated replicas, needing no resources. ``profile``: the replicas'
    GPU-like engine (needed for ``pipeline.mode=fully_async``); ``train_s_per_token``: update
    time per real token of the batch, on top of ``train_s``; ``record``: the actor's record file."""

    def start(cfg: Config, inputs, console) -> Workers:
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
        live = LiveStatus.create(console)
        actor = ray.remote(num_cpus=0)(FakeActor).remote(
            train_s, export_s, live.client(Role.TRAINER), train_s_per_token, record
        )
        # fully_async: a take, a load and a suspension are served while the replica generates (as
        # the real workers, offstep/pipeline/workers.py)
        concurrency = 4 if cfg.pipeline.mode == "fully_async" else 1
        rollout_cls = ray.remote(num_cpus=0, max_concurrency=concurrency)(FakeRollout)

        def make_rollout(i: int):
            return rollout_cls.remote(gen_s, load_s, live.client(replica(i)), profile)

        workers = Workers(
            RoleGroup(Role.ACTOR, [actor]),
            [make_rollout(i) for i in range(cfg.rollout.replicas)],
            make_rollout,
            live,
            owns_ray=owns_ray,
        )
        workers.ready()
        return workers

    return start


class FakePool:
    """Simulated workers made once and reset for each run (a benchmark of many short runs: Ray
    starts a process per actor, seconds each on a busy machine). Replicas for batch mode run one
    call at a time (a generation and the load queued behind it keep their order); those for
    ``fully_async`` run four (as :func:`fake_workers`) and are made afresh for each run. Progress
    goes nowhere."""

    def __init__(self, replicas: int):
        self.replicas = replicas
        self.actor = ray.remote(num_cpus=0)(FakeActor).remote(0.0, 0.0, ProgressClient())
        self.rollout: dict[str, list] = {}

    def _replicas(self, mode: str) -> list:
        # fully_async: fresh replicas for every run. A poll's take sent by the run before may still
        # be waiting for a thread of a reused replica, and would take the next run's groups.
        if mode not in self.rollout or mode == "fully_async":
            for old in self.rollout.get(mode, []):
                ray.kill(old)
            cls = ray.remote(num_cpus=0, max_concurrency=4 if mode == "fully_async" else 1)(FakeRollout)
            self.rollout[mode] = [cls.remote(0.0, 0.0, ProgressClient()) for _ in range(self.replicas)]
        return self.rollout[mode]

    def start(
        self,
        gen_s: float,
        train_s: float,
        export_s: float,
        load_s: float,
        profile: GpuProfile | None = None,
        train_s_per_token: float = 0.0,
    ):
        """A ``start(cfg, inputs, console) -> Workers`` (as :func:`fake_workers`) over the pooled actors."""

        def start(cfg: Config, inputs, console) -> Workers:
            assert cfg.rollout.replicas == self.replicas
            rollout = self._replicas(cfg.pipeline.mode)
            ray.get(
                [self.actor.reset.remote(train_s, export_s, train_s_per_token)]
                + [r.reset.remote(gen_s, load_s, profile) for r in rollout]
            )
            return _Pooled(RoleGroup(Role.ACTOR, [self.actor]), list(rollout), None, LiveStatus.create(console))

        return start


class _Pooled(Workers):
    def close(self, keep_them: bool = False) -> None:  # the actors stay for the next run
        self.live.close()


def sim_config(out: Path, k: int, steps: int, *extra: str) -> Config:
    """The tiny preset's data (prompts tokenised, no model run), no KL term, no validation, no checkpoint."""
    return load_config(
        [
            "preset=tiny",
            f"pipeline.max_staleness={k}",
            f"trainer.total_steps={steps}",
            f"trainer.output_dir={out}",
            "trainer.progress=off",
            "trainer.val_before_train=false",
            "trainer.val_freq=0",
            "trainer.log_samples_freq=0",
            "trainer.save_last=false",  # fake workers write no model, only the actor's update count
            "algorithm.use_kl_loss=false",
            "data.task_val_size=4",
            "data.train_batch_size=8",
            "rollout.n=4",
            *extra,
        ]
    )


def run_sim(cfg: Config, gen_s: float, train_s: float, export_s: float, load_s: float, **kw) -> list[dict]:
    """``train(cfg)`` on simulated workers with these stage durations (seconds); ``kw``: the
    options of :func:`fake_workers` (``profile``, ``train_s_per_token``, ``record``). The
    simulated workers take no cores, so the check that the run's cores fit this machine is left
    out (two replicas beside the trainer on 2 cores)."""
    return train_on(cfg, fake_workers(gen_s, train_s, export_s, load_s, **kw))


def train_on(cfg: Config, start) -> list[dict]:
    """``train(cfg, start)`` without the check that the run's cores fit this machine (simulated
    workers take none)."""
    from offstep.launch import preflight

    check = preflight._check_devices
    preflight._check_devices = lambda *args: None
    try:
        return train(cfg, start=start)
    finally:
        preflight._check_devices = check


def ideal_step(k: int, gen_s: float, train_s: float, export_s: float, load_s: float) -> float:
    """The step time the critical path allows: with k = 0 every stage is serial; with k >= 1 the
    trainer's cycle (train + export) and the replica's (gen + load) overlap."""
    return gen_s + train_s + export_s + load_s if k == 0 else max(gen_s + load_s, train_s + export_s)
