"""Runs one after another in one Python process, on fresh workers against kept ones
(the test suite's keeper, ``tests/keep_workers.py``), side by side in one run.

The tiny preset, one-step, a few steps per run, on a Ray started once (as the test suite's
session does). The settings alternate (fresh, kept, fresh, kept, ...) so that a change of the
host's load falls on both. A fresh run starts its worker processes (each imports torch and
transformers and loads its model); a kept run builds its workers inside the processes the run
before it kept. Reported per setting: the median, lowest and highest wall time of a whole
``train`` call, and whether every kept run's metrics (timings aside) equalled the fresh runs'.

    python -m benchmarks.keep_workers                 # 5 rounds of 2-step runs
    python -m benchmarks.keep_workers --rounds 3 --steps 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS, cpu_kind, provenance
from benchmarks.readme import publish

_TIMED = ("timing_s/", "perf/", "/busy", "_s/", "wait")


def run(steps: int, out: Path) -> tuple[float, list[dict]]:
    from offstep.launch.loader import load_config
    from offstep.pipeline.controller import train

    cfg = load_config(
        [
            "preset=tiny",
            "pipeline.max_staleness=1",
            f"trainer.total_steps={steps}",
            f"trainer.output_dir={out}",
            "trainer.progress=off",
            "trainer.save_last=false",
        ]
    )
    t0 = time.perf_counter()
    history = train(cfg)
    return time.perf_counter() - t0, [{k: v for k, v in m.items() if not any(t in k for t in _TIMED)} for m in history]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "results_keep.md"))
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from offstep.launch.loader import load_config
    from offstep.pipeline.ray_init import init_ray
    from tests.keep_workers import keep_workers, release

    init_ray(load_config(["preset=tiny"]))
    times: dict[str, list[float]] = {"fresh": [], "kept": []}
    reference, same = None, True
    try:
        with tempfile.TemporaryDirectory() as d, keep_workers():
            run(args.steps, Path(d) / "warm-up")  # the first run also builds the tiny model's cache and imports
            for r in range(args.rounds):
                for setting in ("fresh", "kept"):
                    if setting == "fresh":
                        release()  # nothing kept: this run starts its own processes, and keeps them for the next
                    s, metrics = run(args.steps, Path(d) / f"{setting}-{r}")
                    times[setting].append(s)
                    reference = reference or metrics
                    same = same and metrics == reference
                    print(f"round {r} {setting}: {s:.2f} s", flush=True)
    finally:
        ray.shutdown()

    fresh = statistics.median(times["fresh"])
    lines = [
        "# Runs on fresh workers against kept ones",
        "",
        provenance(),
        "",
        f"Machine: {os.cpu_count()} cores ({cpu_kind()}); nothing else running. The tiny preset, one-step, "
        f"{args.steps} steps a run, no final checkpoint; {args.rounds} alternating rounds after one warm-up run, on a Ray "
        "started once. Seconds: the whole `train` call.",
        "",
        "| workers | runs | median s | lowest s | highest s | speed vs fresh |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for setting, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {setting} | {len(ts)} | {med:.2f} | {min(ts):.2f} | {max(ts):.2f} | {fresh / med:.1f}x |")
    lines += [
        "",
        f"Every run's metrics, timings aside, equal the first run's: {'yes' if same else 'NO'}.",
        "",
        f"Regenerate: `python -m benchmarks.keep_workers --rounds {args.rounds} --steps {args.steps}`.",
    ]
    publish("keep", args.out, lines)


if __name__ == "__main__":
    main()
