"""Fully asynchronous against batch pipelines, on simulated workers with a GPU-like profile.

The real ``Controller.fit`` loop (``pipeline.mode=batch`` and ``fully_async``) drives the simulated
workers of ``tests/fakes.py`` (``GpuProfile``): each rollout replica is a serving engine with
continuous batching whose decode step takes ``step_s`` whatever the number of running samples, up
to ``slots`` of them; a sample's length is drawn from a lognormal (median, sigma: the tail) by its
own random stream, the same in every mode; the actor's update takes ``train_s_per_token`` per
real token of the batch (prompt and response). A fully asynchronous replica's weight loads land
between decode steps and its in-flight samples continue (``rollout.partial=keep``).

Setting: 2 replicas, 8 prompt groups x 4 samples a step, ``slots`` = 16 (one step's share of a
replica: the KV cache holds one batch's width), weight export 10 ms, load 20 ms.

**The ideal** is the busier side's work alone, with no barrier and no idle slot: a step's update
time (``train_s_per_token`` x the expected tokens of a batch), or the replicas' decode steps for a
batch with every slot always busy (expected length x ``step_s``, since a replica's ``slots`` are
exactly its share of a step's samples), whichever is larger; ideal samples/s = 32 / that. The
weight sync (30 ms a step) is left out of it. A batch pipeline pays the longest sample of each
batch instead of the mean length (synchronous: the sum of generation and update; one-step: the
larger of the two); the fully asynchronous one can approach the ideal.

Measured: samples/s = 32 / the mean ``timing_s/step`` over steps 3..N (steps 1 and 2 fill the
pipeline). Each row is one run; run-to-run noise on a shared 2-core machine is a few percent.

    python -m benchmarks.async_sim              # writes results_async_sim.md and its section of README.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import ray

from benchmarks.common import RESULTS, cpu_kind, provenance
from benchmarks.readme import refresh
from tests.fakes import FakePool, GpuProfile, sim_config, train_on  # the simulated workers are a test helper

OUT = RESULTS / "results_async_sim.md"
B, N, R = 8, 4, 2  # groups a step, samples a group, replicas
SLOTS = B * N // R
MODES = [
    ("batch", 0, "sync (batch, k=0)"),
    ("batch", 1, "one-step (batch, k=1)"),
    ("batch", 4, "batch, k=4"),
    ("fully_async", 1, "fully async, k=1"),
    ("fully_async", 4, "fully async, k=4"),
]
PEERS = [
    ("verl fully-async (128 GPUs), against its sync", "2.35x"),
    ("verl fully-async (32 GPUs), against its sync", "2.66x"),
    ("verl one-step off-policy, against its sync", "1.23-1.40x"),
    ("AReaL asynchronous, against synchronous", "2.77x"),
    ("ROLL Flash, RLVR, against synchronous", "2.24x"),
]


def expected(profile: GpuProfile, cap: int, prompt_len: float) -> tuple[float, float]:
    """(mean response length, mean tokens of a sample) under ``profile``, by 20,000 draws."""
    lengths = [profile.length(7, s, cap)[0] for s in range(20_000)]
    mean = float(np.mean(lengths))
    return mean, mean + prompt_len


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--step-ms", type=float, default=2.0, help="one decode step, ms")
    ap.add_argument("--median", type=float, default=60.0, help="median response length, tokens")
    ap.add_argument("--cap", type=int, default=1024, help="rollout.max_new_tokens")
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.5, 1.0, 1.5], help="lognormal sigmas (the tail)")
    ap.add_argument(
        "--ratios", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="trainer time / ideal rollout time a step"
    )
    ap.add_argument(
        "--no-readme", action="store_true", help="print the table only: leave results_async_sim.md and README.md alone"
    )
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    t_start = time.time()
    base_sigma, base_ratio = 1.0, 1.0
    settings = [(s, base_ratio) for s in args.sigmas] + [(base_sigma, r) for r in args.ratios if r != base_ratio]

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    pool = FakePool(R)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as d:
            from offstep.pipeline.inputs import prepare_inputs

            probe = sim_config(Path(d) / "probe", 0, 1, "rollout.replicas=2")
            prompt_len = float(np.mean([len(p.prompt_ids) for p in prepare_inputs(probe, Path(d) / "inputs").train]))
            for sigma, ratio in settings:
                profile = GpuProfile(step_s=args.step_ms / 1000, slots=SLOTS, len_median=args.median, len_sigma=sigma)
                mean_len, mean_tok = expected(profile, args.cap, prompt_len)
                roll_s = mean_len * profile.step_s  # a step's decode with every slot busy
                train_s = ratio * roll_s
                per_token = train_s / (B * N * mean_tok)
                ideal = B * N / max(train_s, roll_s)
                for mode, k, label in MODES:
                    cfg = sim_config(
                        Path(d) / f"{sigma}-{ratio}-{mode}-{k}",
                        k,
                        args.steps,
                        f"pipeline.mode={mode}",
                        "rollout.replicas=2",
                        f"rollout.max_new_tokens={args.cap}",
                        "pipeline.colocate=false",
                        "rollout.partial=keep",
                    )
                    hist = train_on(cfg, pool.start(0.0, 0.0, 0.01, 0.02, profile=profile, train_s_per_token=per_token))
                    steps = [m for m in hist if m["step"] >= 3]
                    step_s = statistics.mean(m["timing_s/step"] for m in steps)
                    partial = sum(m.get("rollout/partial_samples", 0) for m in steps) / len(steps)
                    wait = statistics.mean(m["timing_s/wait_gen"] for m in steps)
                    rows.append(
                        dict(
                            sigma=sigma,
                            ratio=ratio,
                            label=label,
                            mode=mode,
                            k=k,
                            sps=B * N / step_s,
                            ideal=ideal,
                            step_s=step_s,
                            wait=wait,
                            partial=partial,
                            mean_len=mean_len,
                            stale=max(m["rollout/staleness_max"] for m in steps),
                        )
                    )
                    print(
                        f"sigma {sigma} ratio {ratio} {label}: {B * N / step_s:.1f} samples/s "
                        f"(ideal {ideal:.1f}), step {step_s:.3f} s, trainer wait {wait:.3f} s, partial {partial:.1f}",
                        flush=True,
                    )
    finally:
        ray.shutdown()
    section = render(rows, args, time.time() - t_start)
    print(section)
    if not args.no_readme:
        OUT.write_text(section + "\n")
        refresh("async-sim")


def render(rows: list[dict], args, took: float) -> str:
    cmd = "python -m benchmarks.async_sim" + (f" --steps {args.steps}" if args.steps != 9 else "")
    sync = {(r["sigma"], r["ratio"]): r["sps"] for r in rows if r["mode"] == "batch" and r["k"] == 0}
    lines = [
        "# Fully asynchronous against batch, simulated",
        "",
        provenance(),
        "",
        f"`{cmd}` ({took / 60:.1f} minutes). The real controller loop on the simulated "
        f"workers of `tests/fakes.py` with a GPU-like profile: a decode step takes {args.step_ms:g} ms whatever the "
        f"number of running samples (continuous batching, {SLOTS} slots a replica: one step's share), lengths are "
        f"lognormal (median {args.median:g} tokens, cap {args.cap}; sigma is the tail), the actor's update time is "
        f"proportional to the batch's tokens, and a fully asynchronous replica loads weights between decode steps "
        f"(`rollout.partial=keep`). {R} replicas, {B} groups x {N} samples a step, {args.steps} steps a run, "
        f"samples/s from the mean step time over steps 3..{args.steps}. Machine: {platform.machine()} "
        f"({cpu_kind()}), {os.cpu_count()} cores shared with other work, Python {platform.python_version()}, "
        f"Ray {ray.__version__}. Simulated: these are ratios of schedules, not of a model on a GPU.",
        "",
        "Ideal: the busier side's work alone, with no barrier and no idle slot: the larger of a step's update "
        "time and its decode time with every slot busy (expected length x step time), samples/s = 32 / that; the "
        "weight sync (30 ms a step) is left out. Ratio: trainer time / that decode time. `vs sync`: against the "
        "synchronous row of the same setting.",
        "",
        "| tail sigma | trainer/rollout | mean length | mode | samples/s | of ideal | vs sync | trainer wait s | partial samples a step | max staleness |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['sigma']:g} | {r['ratio']:g} | {r['mean_len']:.0f} | {r['label']} | {r['sps']:.1f} | "
            f"{r['sps'] / r['ideal']:.0%} | {r['sps'] / sync[r['sigma'], r['ratio']]:.2f}x | {r['wait']:.2f} | "
            f"{r['partial']:.1f} | {r['stale']} |"
        )
    lines += [
        "",
        "Published speed-ups of peers, **theirs, not ours** (real models on GPUs, their own baselines):",
        "",
        "| system | speed-up |",
        "| --- | --- |",
    ]
    lines += [f"| {name} | {x} |" for name, x in PEERS]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
