"""The controller's own overhead: the real ``Controller.fit`` loop driving simulated workers.

``SimController`` is the real controller (asyncio loop, Ray calls, collate, staleness check,
advantages, metrics, timeline, weight-sync bookkeeping) with ``_start_workers`` replaced: the
rollout replicas and the actor are Ray actors with the real workers' method names and return
shapes that sleep for configured durations instead of running a model:

Like the real workers, they push their progress to the live-status hub.

* ``SimRollout.generate`` -> ``(samples, timing)``: ``rollout.n`` scored ``Sample``s per request,
  a few random tokens each, tagged with the worker's policy version, after ``gen_s``;
  ``load_weights`` takes ``load_s`` and sets the version;
* ``SimActor.update`` / ``compute_logprobs`` -> ``(result, {start, end})`` after ``train_s``;
  ``export_weights`` -> ``[ObjectRef]`` after ``export_s``.

The ideal step time follows from the pipeline's critical path: with k = 0 every stage is serial,
``gen + train + export + load``; with k >= 1 the trainer's cycle (train + export) and the rollout
worker's cycle (gen + load, its calls run in submission order) overlap, so the step takes
``max(gen + load, train + export)`` — the issue's "max(generation, training) + sync", with the sync
split between the side that pays it. Reported: the median ``timing_s/step`` over steps 3..N (step 1
and 2 fill the pipeline), the ideal, and the overhead ``step / ideal - 1``.

    python benchmarks/controller_overhead.py                  # k = 0, 1, 2 x three duration settings
    python benchmarks/controller_overhead.py --steps 12 --settings 0.5,0.5 1.0,0.5
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch

from offstep.batch import Sample
from offstep.config.loader import load_config
from offstep.config.schema import Config
from offstep.pipeline.controller import Controller
from offstep.pipeline.pools import RoleGroup
from offstep.telemetry.progress import LiveStatus, ProgressClient

if __name__ != "__main__":  # imported by path (the tests): Ray ships these classes by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SimRollout:
    """A rollout replica that sleeps instead of generating; same calls and results as ``RolloutWorker``."""

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
        t1 = time.time()
        return samples, {"start": t0, "end": t1, "score_tail": 0.0, "version": self.version}

    def load_weights(self, packed, version: int) -> dict:
        t0 = time.time()
        time.sleep(self.load_s)
        self.version = version
        return {"start": t0, "end": time.time(), "version": version}


class SimActor:
    """The actor role, sleeping instead of training; same calls and results as ``ActorWorker``."""

    def __init__(self, train_s: float, export_s: float, progress: ProgressClient):
        self.train_s, self.export_s, self.updates, self.progress = train_s, export_s, 0, progress

    def _timed_sleep(self, s: float) -> dict:
        t0 = time.time()
        time.sleep(s)
        return {"start": t0, "end": time.time()}

    def update(self, batch) -> tuple[dict, dict]:
        self.progress.start("update_actor", 1)
        t = self._timed_sleep(self.train_s)
        self.progress.advance()
        self.updates += 1
        return {"pg_loss": 0.0, "grad_norm": 1.0, "entropy": 1.0, "lr": 1e-6, "skipped_steps": 0.0}, t

    def compute_logprobs(self, batch) -> tuple[torch.Tensor, dict]:
        t = self._timed_sleep(self.train_s)
        return torch.zeros_like(batch.rollout_logprobs), t

    def export_weights(self) -> list:
        time.sleep(self.export_s)
        return [ray.put({"version": self.updates})]

    def shutdown(self) -> None:
        pass


class SimController(Controller):
    """The real controller; only the workers it starts are simulated (and need no resources)."""

    def __init__(self, cfg: Config, gen_s: float, train_s: float, export_s: float, load_s: float):
        super().__init__(cfg)
        self.sim = dict(gen_s=gen_s, train_s=train_s, export_s=export_s, load_s=load_s)

    def _start_workers(self) -> None:
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
        s = self.sim
        self.trainer_pool = self.rollout_pool = None
        self.ref = self.critic = None
        self.live = LiveStatus.create(self.console)
        actor = ray.remote(num_cpus=0)(SimActor).remote(s["train_s"], s["export_s"], self.live.client("trainer"))
        self.actor = RoleGroup("actor", [actor])
        rollout_cls = ray.remote(num_cpus=0)(SimRollout)
        self._make_rollout_worker = lambda i: rollout_cls.remote(s["gen_s"], s["load_s"], self.live.client(f"rollout/{i}"))
        self.rollout = [self._make_rollout_worker(i) for i in range(self.cfg.rollout.replicas)]
        ray.get([w.__ray_ready__.remote() for w in self.rollout] + [actor.__ray_ready__.remote()])


def sim_config(out: Path, k: int, steps: int, *extra: str) -> Config:
    """The tiny preset's data (prompts tokenised, no model run), no KL term, no validation."""
    return load_config([
        "preset=tiny", f"pipeline.max_staleness={k}", f"trainer.total_steps={steps}", f"trainer.output_dir={out}",
        "trainer.progress=off", "trainer.val_before_train=false", "trainer.val_freq=0", "trainer.log_samples_freq=0",
        "algorithm.use_kl_loss=false", "data.task_val_size=4", "data.train_batch_size=8", "rollout.n=4", *extra,
    ])


def run_sim(cfg: Config, gen_s: float, train_s: float, export_s: float, load_s: float) -> list[dict]:
    ctl = SimController(cfg, gen_s, train_s, export_s, load_s)
    try:
        ctl.setup()
        return asyncio.run(ctl.fit())
    finally:
        ctl.close()


def ideal_step(k: int, gen_s: float, train_s: float, export_s: float, load_s: float) -> float:
    return gen_s + train_s + export_s + load_s if k == 0 else max(gen_s + load_s, train_s + export_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="+", default=["0.5,0.5", "1.0,0.5", "0.5,1.0"], help="gen_s,train_s pairs")
    ap.add_argument("--export-s", type=float, default=0.05)
    ap.add_argument("--load-s", type=float, default=0.05)
    ap.add_argument("--out", default=str(Path(__file__).with_name("results_controller.md")))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    rows = []
    try:
        for setting in args.settings:
            gen_s, train_s = map(float, setting.split(","))
            for k in args.ks:
                with tempfile.TemporaryDirectory() as d:
                    hist = run_sim(sim_config(Path(d), k, args.steps), gen_s, train_s, args.export_s, args.load_s)
                steps = [m["timing_s/step"] for m in hist if m["step"] >= 3]
                med, ideal = statistics.median(steps), ideal_step(k, gen_s, train_s, args.export_s, args.load_s)
                rows.append((gen_s, train_s, k, med, min(steps), max(steps), ideal))
                print(f"gen {gen_s} train {train_s} k={k}: step {med:.3f} s, ideal {ideal:.3f} s, "
                      f"overhead {med / ideal - 1:+.1%}", flush=True)
    finally:
        ray.shutdown()

    lines = [
        "# Controller overhead with simulated workers",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, Ray {ray.__version__}. "
        f"The real `Controller.fit` with sleeping Ray actors (`benchmarks/controller_overhead.py`); 1 rollout replica, "
        f"1 actor rank; 8 prompts x 4 samples per step; export {args.export_s:g} s (trainer side), load {args.load_s:g} s "
        f"(rollout side); {args.steps} steps per run, median over steps 3..{args.steps}.",
        "",
        "Ideal: k = 0, gen + train + export + load; k >= 1, max(gen + load, train + export).",
        "",
        "| gen s | train s | k | step s (median) | min | max | ideal s | overhead |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for gen_s, train_s, k, med, lo, hi, ideal in rows:
        lines.append(f"| {gen_s:g} | {train_s:g} | {k} | {med:.3f} | {lo:.3f} | {hi:.3f} | {ideal:.3f} | {med / ideal - 1:+.1%} |")
    lines += ["", f"Regenerate: `python benchmarks/controller_overhead.py --steps {args.steps}`."]
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
