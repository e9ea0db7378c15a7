"""The sandbox's cost (offstep/sandbox, docs/sandbox.md): start-up overhead of one execution
against a plain subprocess, and throughput at several concurrencies.

Overhead: ``--runs`` executions of an empty program, one at a time, in the sandbox and as a plain
``subprocess.run([python3, -c, pass])`` of the same interpreter; median and p95 seconds of each,
and their difference. Throughput: ``--jobs`` executions of a short CPU-bound program
(``--work`` loop iterations) submitted from as many threads as the concurrency, through one
``Sandbox`` with that concurrency: executions per second and the mean queue wait.

    python -m benchmarks.sandbox                       # 40 runs; concurrency 1, 2, 8
    python -m benchmarks.sandbox --runs 100 --concurrency 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import RESULTS, provenance
from benchmarks.readme import refresh
from offstep.sandbox import SYSTEM_PYTHON, Limits, Sandbox, problem


def p95(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(0.95 * len(xs)) - 1))]


def overhead(runs: int) -> tuple[list[float], list[float]]:
    sandbox = Sandbox(Limits(), concurrency=1)
    boxed, plain = [], []
    for _ in range(runs):
        boxed.append(sandbox.run("pass").seconds)
        t0 = time.monotonic()
        subprocess.run([SYSTEM_PYTHON, "-c", "pass"], check=True)
        plain.append(time.monotonic() - t0)
    return boxed, plain


def throughput(concurrency: int, jobs: int, work: int) -> tuple[float, float]:
    sandbox = Sandbox(Limits(), concurrency=concurrency)
    code = f"n = 0\nfor i in range({work}):\n    n += i\nprint(n)"
    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda _: sandbox.run(code), range(jobs)))
    wall = time.monotonic() - t0
    assert all(r.ok for r in results), [r.describe() for r in results if not r.ok][:3]
    return jobs / wall, statistics.mean(r.queue_wait_s for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 8])
    ap.add_argument("--jobs", type=int, default=32)
    ap.add_argument("--work", type=int, default=200_000)
    ap.add_argument("--out", default=str(RESULTS / "results_sandbox.md"))
    args = ap.parse_args()
    why = problem()
    if why is not None:
        sys.exit(f"benchmarks/sandbox.py: {why}")
    boxed, plain = overhead(args.runs)
    lines = [
        "# The sandbox's cost",
        "",
        provenance(),
        "",
        f"Start-up: {args.runs} executions of an empty program, one at a time.",
        "",
        "| | median s | p95 s |",
        "| --- | --- | --- |",
        f"| sandbox | {statistics.median(boxed):.3f} | {p95(boxed):.3f} |",
        f"| plain subprocess | {statistics.median(plain):.3f} | {p95(plain):.3f} |",
        f"| overhead | {statistics.median(boxed) - statistics.median(plain):.3f} | {p95(boxed) - p95(plain):.3f} |",
        "",
        f"Throughput: {args.jobs} executions of a {args.work:,}-iteration loop.",
        "",
        "| concurrency | executions/s | mean queue wait s |",
        "| --- | --- | --- |",
    ]
    for c in args.concurrency:
        rate, wait = throughput(c, args.jobs, args.work)
        lines.append(f"| {c} | {rate:.1f} | {wait:.3f} |")
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    refresh("sandbox", args.out)


if __name__ == "__main__":
    main()
