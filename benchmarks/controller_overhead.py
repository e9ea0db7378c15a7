"""The controller's own overhead: the real ``Controller.fit`` loop driving simulated workers.

The workers are those of ``tests/fakes.py``: Ray actors with the real workers' method names and
results that sleep for set durations instead of running a model (the rollout replica for
``gen_s`` per generation and ``load_s`` per weight load, the actor for ``train_s`` per update and
``export_s`` per export). Everything else is the real loop: asyncio, Ray calls, collate, the
staleness check, advantages, metrics, timeline and the weight-sync bookkeeping.

The ideal step time follows from the pipeline's critical path: with k = 0 every stage is serial,
``gen + train + export + load``; with k >= 1 the trainer's cycle (train + export) and the rollout
worker's cycle (gen + load, its calls run in submission order) overlap, so the step takes
``max(gen + load, train + export)`` — the issue's "max(generation, training) + sync", with the sync
split between the side that pays it. Reported: the median ``timing_s/step`` over steps 3..N (step 1
and 2 fill the pipeline), the ideal, and the overhead ``step / ideal - 1``.

    python -m benchmarks.controller_overhead                  # k = 0, 1, 2 x three duration settings
    python -m benchmarks.controller_overhead --steps 12 --settings 0.5,0.5 1.0,0.5
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
from pathlib import Path

import ray

from benchmarks.common import RESULTS, provenance
from benchmarks.readme import publish
from tests.fakes import ideal_step, run_sim, sim_config  # the simulated workers are a test helper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--settings", nargs="+", default=["0.5,0.5", "1.0,0.5", "0.5,1.0"], help="gen_s,train_s pairs")
    ap.add_argument("--export-s", type=float, default=0.05)
    ap.add_argument("--load-s", type=float, default=0.05)
    ap.add_argument("--out", default=str(RESULTS / "results_controller.md"))
    args = ap.parse_args()
    if args.steps < 3:
        ap.error(f"--steps {args.steps}: at least 3 (the medians are over steps 3 and later)")
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
                print(
                    f"gen {gen_s} train {train_s} k={k}: step {med:.3f} s, ideal {ideal:.3f} s, "
                    f"overhead {med / ideal - 1:+.1%}",
                    flush=True,
                )
    finally:
        ray.shutdown()

    lines = [
        "# Controller overhead with simulated workers",
        "",
        provenance(),
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
        lines.append(
            f"| {gen_s:g} | {train_s:g} | {k} | {med:.3f} | {lo:.3f} | {hi:.3f} | {ideal:.3f} | {med / ideal - 1:+.1%} |"
        )
    lines += ["", f"Regenerate: `python -m benchmarks.controller_overhead --steps {args.steps}`."]
    publish("controller", args.out, lines)


if __name__ == "__main__":
    main()
