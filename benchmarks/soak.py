"""Soak test: a long tiny run in one-step mode must hold every process's memory, open files and
threads flat.

    .venv/bin/python -m benchmarks.soak [--steps 200] [--every 10] [--warmup 20]

Runs ``offstep train preset=tiny pipeline.max_staleness=1 trainer.total_steps=STEPS`` in a
subprocess and, every ``--every`` steps (read from its metrics.jsonl), samples with psutil the
resident memory (RSS), open file descriptors and threads of the driver and of every process it
started (Ray's GCS and raylet, the rollout / actor / reference workers). The first samples at or
after ``--warmup`` steps are the baseline: allocators, caches and Ray's pools settle in the first
steps; each process's first and last values are medians of three samples. Writes ``benchmarks/results/results_soak.md`` (baseline vs last sample, growth, and a least-squares
slope per step) and exits 1 if any process grew beyond the thresholds below, or if the run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.common import RESULTS, ROOT, provenance
from benchmarks.readme import refresh

MIB = 1024 * 1024

# "Flat" means: over the measured window, each process's RSS grows by at most RSS_LIMIT_MIB, and
# its open files and threads by at most FD_LIMIT and THREAD_LIMIT (a descriptor or thread opened
# once late, e.g. a log file rotated, is not a leak; one per step would be 180).
RSS_LIMIT_MIB = 20.0
FD_LIMIT = 2
THREAD_LIMIT = 2


@dataclass
class Track:
    """One process of the run and its samples: (step, rss bytes, fds, threads)."""

    pid: int
    role: str
    samples: list[tuple[int, int, int, int]] = field(default_factory=list)


def role_of(proc: psutil.Process, driver_pid: int) -> str:
    if proc.pid == driver_pid:
        return "driver"
    try:
        cmd = proc.cmdline()
        name = proc.name()
    except psutil.Error:
        return "?"
    text = " ".join(cmd)
    if text.startswith("ray::"):
        return text.split()[0].split(".")[0]  # ray::RolloutWorker, ray::ActorWorker, ray::IDLE (not the method)
    for known in ("gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if known in text:
            return known
    return name


def sample(driver: psutil.Process, tracks: dict[int, Track], step: int) -> None:
    try:
        procs = [driver, *driver.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            with proc.oneshot():
                values = (step, proc.memory_info().rss, proc.num_fds(), proc.num_threads())
            track = tracks.get(proc.pid)
            if track is None:
                track = tracks[proc.pid] = Track(proc.pid, role_of(proc, driver.pid))
            elif track.role == "ray::IDLE":  # an idle worker becomes an actor: take its new name
                track.role = role_of(proc, driver.pid)
            track.samples.append(values)
        except psutil.Error:
            continue


def last_step(metrics: Path) -> int:
    if not metrics.exists():
        return -1
    step = -1
    with metrics.open() as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    step = max(step, int(json.loads(line).get("step", -1)))
                except (ValueError, json.JSONDecodeError):
                    pass  # a line being written
    return step


def _median3(samples: list[tuple[int, int, int, int]]) -> tuple[int, int, int, int]:
    """(first step, then the median of each value) of up to three samples."""
    cols = list(zip(*samples))
    return (cols[0][0], *(sorted(c)[len(c) // 2] for c in cols[1:]))


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of value over step."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=10, help="sample every N steps")
    ap.add_argument("--warmup", type=int, default=20, help="the baseline is the first sample at or after this step")
    ap.add_argument("--out", default=str(RESULTS / "results_soak.md"))
    ap.add_argument("overrides", nargs="*", help="extra offstep train overrides")
    args = ap.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="offstep_soak_"))
    overrides = [
        "preset=tiny",
        "pipeline.max_staleness=1",
        f"trainer.total_steps={args.steps}",
        f"trainer.output_dir={run_dir}",
        "trainer.progress=plain",
        *args.overrides,
    ]
    cmd = [str(Path(sys.executable).with_name("offstep")), "train", *overrides]
    log = (run_dir / "soak.log").open("w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env={**os.environ, "RAY_ADDRESS": ""})
    driver = psutil.Process(proc.pid)
    tracks: dict[int, Track] = {}
    next_at = 0
    metrics = run_dir / "metrics.jsonl"
    while proc.poll() is None:
        step = last_step(metrics)
        if step >= next_at and step >= 1:
            sample(driver, tracks, step)
            next_at = (step // args.every + 1) * args.every
        time.sleep(0.05)
    wall = time.time() - t0
    log.close()
    if proc.returncode != 0:
        print((run_dir / "soak.log").read_text()[-4000:])
        print(f"soak: the run failed (exit code {proc.returncode}); log in {run_dir / 'soak.log'}")
        return 1

    rows, failures = [], []
    for t in sorted(tracks.values(), key=lambda t: (t.role, t.pid)):
        # The sample at the last step may catch the run winding down (final validation, shutdown).
        window = [s for s in t.samples if args.warmup <= s[0] < args.steps]
        if len(window) < 2:
            continue  # a short-lived process (e.g. a runtime-env helper), not part of the steady state
        # Medians of the first and of the last three samples: a thread or descriptor that lives for
        # a moment (a scorer call, a Ray RPC) is not growth; a leak shows in all three.
        (s0, r0, f0, h0), (s1, r1, f1, h1) = _median3(window[:3]), _median3(window[-3:])
        rss_growth = (r1 - r0) / MIB
        kib_per_step = slope([(s, r / 1024) for s, r, _, _ in window])
        rows.append(
            f"| {t.role} | {t.pid} | {s0}->{s1} | {r0 / MIB:.1f} | {r1 / MIB:.1f} | {rss_growth:+.1f} | {kib_per_step:+.1f} "
            f"| {f0} | {f1} | {f1 - f0:+d} | {h0} | {h1} | {h1 - h0:+d} |"
        )
        if rss_growth > RSS_LIMIT_MIB:
            failures.append(f"{t.role} (pid {t.pid}): RSS grew {rss_growth:.1f} MiB > {RSS_LIMIT_MIB} MiB")
        if f1 - f0 > FD_LIMIT:
            failures.append(f"{t.role} (pid {t.pid}): open files grew by {f1 - f0} > {FD_LIMIT}")
        if h1 - h0 > THREAD_LIMIT:
            failures.append(f"{t.role} (pid {t.pid}): threads grew by {h1 - h0} > {THREAD_LIMIT}")
    counts = {}
    for t in tracks.values():
        for s in t.samples:
            counts[s[0]] = counts.get(s[0], 0) + 1
    steps_sampled = sorted(counts)
    base = next((s for s in steps_sampled if s >= args.warmup), None)
    if base is not None and counts[steps_sampled[-1]] > counts[base]:
        failures.append(
            f"the run has {counts[steps_sampled[-1]]} processes at step {steps_sampled[-1]}, {counts[base]} at step {base}"
        )

    verdict = "PASS: flat" if not failures else "FAIL:\n" + "\n".join(f"- {f}" for f in failures)
    text = "\n".join(
        [
            "# Soak: the tiny preset, one-step off-policy",
            "",
            provenance(),
            f"(It runs `offstep train {' '.join(o for o in overrides if not o.startswith('trainer.output_dir'))}`).",
            "",
            (
                f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
                f"wall time {wall:.0f} s; samples at steps {', '.join(map(str, steps_sampled))}."
            ),
            "",
            (
                f"First: the median of the first three samples at or after step {args.warmup}; last: the median of the "
                "last three before the last step (`steps` shows the first step of each). "
                f"Thresholds per process: RSS growth <= {RSS_LIMIT_MIB:.0f} MiB, open files <= +{FD_LIMIT}, "
                f"threads <= +{THREAD_LIMIT}, and no more processes than at the baseline. "
                "`KiB/step` is the least-squares slope of RSS over the window."
            ),
            "",
            (
                "| process | pid | steps | RSS MiB first | RSS MiB last | growth MiB | KiB/step | fds first | fds last | growth "
                "| threads first | threads last | growth |"
            ),
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            verdict,
            "",
        ]
    )
    Path(args.out).write_text(text)
    print(text)
    refresh("soak", args.out)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
