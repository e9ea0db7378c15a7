"""Simulated workers for the real controller loop: Ray actors with the real workers' method names
and results that sleep for set durations instead of running a model. The loop receives them as
its :class:`~offstep.pipeline.workers.Workers` (``train(cfg, start=fake_workers(...))``).

* ``FakeRollout.generate`` -> ``(samples, GenTiming)``: ``rollout.n`` scored ``Sample`` s per
  request, a few random tokens each, tagged with the replica's policy version, after ``gen_s``;
  ``load_weights`` takes ``load_s``, sets the version and reports the digest of its one "weight"
  (the actor's update count, as exported);
* ``FakeActor.update`` / ``compute_logprobs`` -> ``(result, Span)`` after ``train_s``;
  ``export_weights`` -> ``[ObjectRef, digest]`` after ``export_s``.

Like the real workers, they push their progress to the live-status hub. Used by
``tests/test_controller_sim.py`` and ``benchmarks/controller_overhead.py``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import ray
import torch

from offstep.batch import GenTiming, Sample, Span
from offstep.config.loader import load_config
from offstep.config.schema import Config
from offstep.pipeline.controller import train
from offstep.pipeline.pools import RoleGroup
from offstep.pipeline.workers import Workers
from offstep.sync.collective import TensorSpec
from offstep.sync.digest import Loaded, digest
from offstep.telemetry.progress import LiveStatus, ProgressClient

# Imported by path or as a test helper: Ray ships these classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FakeRollout:
    def __init__(self, gen_s: float, load_s: float, progress: ProgressClient):
        self.gen_s, self.load_s, self.version, self.progress = gen_s, load_s, 0, progress

    def generate(self, requests, params, seed: int, with_ref: bool = True):
        t0 = time.time()
        self.progress.start("gen", len(requests) * params.n, version=self.version)
        g = torch.Generator().manual_seed(seed)
        samples = []
        for r in requests:
            for _ in range(params.n):
                n_tok = int(torch.randint(4, 17, (1,), generator=g))
                samples.append(Sample(
                    uid=r.uid, prompt_ids=list(r.prompt_ids), response_ids=torch.randint(3, 200, (n_tok,), generator=g).tolist(),
                    rollout_logprobs=(-torch.rand(n_tok, generator=g)).tolist(), finish_reason="stop",
                    score=float(torch.randint(0, 2, (1,), generator=g)), version=self.version, data_source=r.data_source,
                ))
        time.sleep(max(0.0, self.gen_s - (time.time() - t0)))
        self.progress.advance(len(samples))
        return samples, GenTiming(Span(t0, time.time(), self.version))

    def weight_sync_manifest(self) -> list:
        return [TensorSpec("w", (1,), "float32")]

    def load_weights(self, packed, version: int) -> Loaded:
        t0 = time.time()
        time.sleep(self.load_s)
        self.version = version
        held = torch.tensor([float(packed["version"])])  # the one "weight" the actor sent
        return Loaded(Span(t0, time.time(), version), digest([("w", held)]), 0.0)


class FakeActor:
    def __init__(self, train_s: float, export_s: float, progress: ProgressClient):
        self.train_s, self.export_s, self.updates, self.progress = train_s, export_s, 0, progress

    def _sleep(self, s: float) -> Span:
        t0 = time.time()
        time.sleep(s)
        return Span(t0, time.time())

    def update(self, batch) -> tuple[dict, Span]:
        self.progress.start("update_actor", 1)
        span = self._sleep(self.train_s)
        self.progress.advance()
        self.updates += 1
        return {"pg_loss": 0.0, "grad_norm": 1.0, "entropy": 1.0, "lr": 1e-6, "skipped_steps": 0.0}, span

    def compute_logprobs(self, batch) -> tuple[torch.Tensor, Span]:
        return torch.zeros_like(batch.rollout_logprobs), self._sleep(self.train_s)

    def set_sync_manifest(self, specs: list) -> None:
        pass

    def export_weights(self) -> list:
        time.sleep(self.export_s)
        return [ray.put({"version": self.updates}), digest([("w", torch.tensor([float(self.updates)]))])]

    def shutdown(self) -> None:
        pass


def fake_workers(gen_s: float, train_s: float, export_s: float, load_s: float):
    """A ``start(cfg, inputs, console) -> Workers`` for the loop: one simulated actor rank and
    ``rollout.replicas`` simulated replicas, needing no resources."""

    def start(cfg: Config, inputs, console) -> Workers:
        owns_ray = not ray.is_initialized()
        if owns_ray:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
        live = LiveStatus.create(console)
        actor = ray.remote(num_cpus=0)(FakeActor).remote(train_s, export_s, live.client("trainer"))
        rollout_cls = ray.remote(num_cpus=0)(FakeRollout)

        def make_rollout(i: int):
            return rollout_cls.remote(gen_s, load_s, live.client(f"rollout/{i}"))

        workers = Workers(RoleGroup("actor", [actor]), [make_rollout(i) for i in range(cfg.rollout.replicas)],
                          make_rollout, live, owns_ray=owns_ray)
        workers.ready()
        return workers

    return start


def sim_config(out: Path, k: int, steps: int, *extra: str) -> Config:
    """The tiny preset's data (prompts tokenised, no model run), no KL term, no validation, no checkpoint."""
    return load_config([
        "preset=tiny", f"pipeline.max_staleness={k}", f"trainer.total_steps={steps}", f"trainer.output_dir={out}",
        "trainer.progress=off", "trainer.val_before_train=false", "trainer.val_freq=0", "trainer.log_samples_freq=0",
        "trainer.save_last=false",  # fake workers write no checkpoints
        "algorithm.use_kl_loss=false", "data.task_val_size=4", "data.train_batch_size=8", "rollout.n=4", *extra,
    ])


def run_sim(cfg: Config, gen_s: float, train_s: float, export_s: float, load_s: float) -> list[dict]:
    """``train(cfg)`` on simulated workers with these stage durations (seconds). No other options:
    the simulated workers take none."""
    return train(cfg, start=fake_workers(gen_s, train_s, export_s, load_s))


def ideal_step(k: int, gen_s: float, train_s: float, export_s: float, load_s: float) -> float:
    """The step time the critical path allows: with k = 0 every stage is serial; with k >= 1 the
    trainer's cycle (train + export) and the replica's (gen + load) overlap."""
    return gen_s + train_s + export_s + load_s if k == 0 else max(gen_s + load_s, train_s + export_s)
