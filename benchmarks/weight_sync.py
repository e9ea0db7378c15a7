"""Weight sync, object store vs collective, measured side by side in one run.

For 1 and 2 rollout workers, one ``ActorWorker`` (FSDP2, one rank) and the ``RolloutWorker``s of a
real run are started as Ray actors, the collective group is made once, and then the two paths
alternate, ``--reps`` times each:

* ``object_store``: ``ActorWorker.export_weights`` (full state dict, numpy, ``ray.put``) then
  ``RolloutWorker.load_weights`` on every worker (what the controller does by default);
* ``collective``: ``RolloutWorker.receive_weights`` queued on every worker, then
  ``ActorWorker.send_weights`` (gloo broadcast in ``--bucket-mb`` buckets).

One sync takes from the moment the actor starts exporting (a timestamp taken in the actor) to the
moment the last rollout worker has the weights in its engine (its own ``end`` timestamp): the
rollout workers are idle, so nothing else is in the way. Reported: the median over repetitions,
the best, and the model's size over that time (GB/s; every worker receives all of it). At the end,
every rollout engine's weights are checked against the actor's, and every sync's digests
(``offstep.sync.digest``) must match; their cost is reported beside the sync's.

    python -m benchmarks.weight_sync                      # SmolLM2-135M fp32, writes results_weight_sync.md
    python -m benchmarks.weight_sync --model tiny --reps 3 --out /tmp/ws.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import ray
import torch

from benchmarks.common import RESULTS, provenance
from benchmarks.readme import refresh
from offstep.config.schema import ActorConfig, AlgorithmConfig
from offstep.models.loading import cache_dir, resolve_model
from offstep.rewards.registry import RewardFunction
from offstep.rollout.replica_spec import RolloutSpec
from offstep.rollout.worker import RolloutWorker
from offstep.sync.collective import connect
from offstep.sync.digest import digest_of
from offstep.train.actor import ActorWorker
from offstep.train.distributed import GroupSpec


def _timed_call(self, method: str, *args):
    t0 = time.time()
    return t0, getattr(self, method)(*args)


def _checksums(self):
    """Per-tensor float64 sums of the weights, on an ActorWorker or a RolloutWorker."""
    sd = self.full_state_dict(self.model) if hasattr(self, "opt") else self.engine.model.state_dict()
    return {k: float(v.double().sum()) for k, v in sd.items()}


def _trainer_digest_s(self) -> float:
    """Seconds the actor's digest of its exported weights takes (``offstep.sync.digest``)."""
    sd = self.full_state_dict(self.model)
    t0 = time.perf_counter()
    digest_of(self._sync_specs, sd.__getitem__)
    return time.perf_counter() - t0


def sync_once(path: str, actor, rollouts, version: int) -> tuple[float, float]:
    """One sync: its seconds, and the slowest worker's digest seconds (inside them). Every
    worker's digest must equal the actor's."""
    if path == "collective":
        loads = [w.receive_weights.remote(version) for w in rollouts]
        t0, sent = ray.get(actor.__ray_call__.remote(_timed_call, "send_weights", version))
    else:
        t0, (ref, sent) = ray.get(actor.__ray_call__.remote(_timed_call, "export_weights"))
        loads = [w.load_weights.remote(ref, version) for w in rollouts]
    reports = ray.get(loads)
    assert all(r.digest == sent for r in reports), f"{path}: a rollout worker's digest differs from the actor's"
    return max(r.span.end for r in reports) - t0, max(r.digest_s for r in reports)


def bench(model: str, replicas: int, reps: int, bucket_mb: float, dtype: str) -> tuple[dict[str, list[float]], int]:
    env = {
        "runtime_env": {"env_vars": {"OFFSTEP_CACHE": str(cache_dir()), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}}
    }
    spec = GroupSpec(0, 1, "127.0.0.1", 0, "cpu", 1)
    actor = (
        ray.remote(ActorWorker)
        .options(num_cpus=0.01, **env)
        .remote(spec, 0, model, "float32", "float32", ActorConfig(), AlgorithmConfig(), 1.0)
    )
    rollouts = [
        ray.remote(RolloutWorker)
        .options(num_cpus=0.01, **env)
        .remote(RolloutSpec.local(model, RewardFunction(), 8, dtype=dtype))
        for _ in range(replicas)
    ]
    try:
        specs = ray.get(rollouts[0].weight_sync_manifest.remote())
        ray.get(actor.set_sync_manifest.remote(specs))
        connect([actor], rollouts, "gloo", bucket_mb, timeout_s=600)
        nbytes = ray.get(
            actor.__ray_call__.remote(lambda self: sum(p.numel() * p.element_size() for p in self.model.parameters()))
        )
        times: dict[str, list[tuple[float, float]]] = {"object_store": [], "collective": []}
        version = 0
        for rep in range(reps + 1):  # the first round warms both paths up and is not counted
            for path in ("object_store", "collective") if rep % 2 == 0 else ("collective", "object_store"):
                version += 1
                s = sync_once(path, actor, rollouts, version)
                if rep:
                    times[path].append(s)
        times["trainer_digest"] = [(ray.get(actor.__ray_call__.remote(_trainer_digest_s)), 0.0) for _ in range(reps)]
        if dtype == "float32":  # the last sync left exactly the actor's weights in every engine
            want = ray.get(actor.__ray_call__.remote(_checksums))
            for w in rollouts:
                got = ray.get(w.__ray_call__.remote(_checksums))
                bad = [k for k in want if got.get(k) != want[k]]
                assert not bad, f"rollout weights differ from the actor's: {bad[:5]}"
        return times, nbytes
    finally:
        for h in [actor, *rollouts]:
            ray.kill(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--dtype", default="float32", help="rollout.dtype")
    ap.add_argument("--out", default=str(RESULTS / "results_weight_sync.md"))
    args = ap.parse_args()
    resolve_model(args.model)  # convert/build the alias once, before the workers race for it
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    load0 = os.getloadavg()[0]
    rows, nbytes = [], 0
    for r in args.replicas:
        times, nbytes = bench(args.model, r, args.reps, args.bucket_mb, args.dtype)
        trainer_digest = statistics.median(t for t, _ in times.pop("trainer_digest"))
        for path, pairs in times.items():
            ts = [t for t, _ in pairs]
            med, dig = statistics.median(ts), statistics.median(d for _, d in pairs)
            rows.append((r, path, med, min(ts), nbytes / 1e9 / med, dig, trainer_digest))
            print(
                f"{r} worker(s) {path:13s} median {med:.3f} s  best {min(ts):.3f} s  {nbytes / 1e9 / med:.2f} GB/s  "
                f"digest {dig:.3f} s (trainer {trainer_digest:.3f} s)",
                flush=True,
            )
    ray.shutdown()
    lines = [
        "# Weight sync: object store vs collective",
        "",
        provenance(),
        "",
        (
            f"Machine: {platform.machine()}, {os.cpu_count()} cores (1-minute load average {load0:.1f} at the start, "
            f"{os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}, Python {platform.python_version()}; "
            f"model `{args.model}`, actor fp32, rollout {args.dtype}, {nbytes / 1e9:.3f} GB of parameters (fp32); "
            f"collective bucket {args.bucket_mb:g} MB (gloo); median and best of {args.reps} syncs per path, the paths "
            "alternating in one run (`python -m benchmarks.weight_sync`)."
        ),
        "",
        (
            "Seconds from the actor starting its export to the last rollout worker having the weights in its engine; "
            "GB/s = model size / median (every worker receives the whole model). Every sync is verified "
            "(`offstep/sync/digest.py`): *rollout digest s* is the slowest worker's digest of what its engine holds after "
            "the load (median; included in the sync's seconds), *trainer digest s* the actor's digest of its export "
            "(median, measured on its own; on the collective path it is taken while packing). Every worker's digest "
            "matched the actor's at every sync."
        ),
        "",
        "| rollout workers | path | median s | best s | GB/s | rollout digest s | trainer digest s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *[f"| {r} | {p} | {m:.3f} | {b:.3f} | {g:.2f} | {d:.3f} | {t:.3f} |" for r, p, m, b, g, d, t in rows],
        "",
    ]
    Path(args.out).write_text("\n".join(lines))
    print(f"wrote {args.out}")
    refresh("weight-sync", args.out)


if __name__ == "__main__":
    main()
