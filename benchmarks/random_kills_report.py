"""The report of ``benchmarks/random_kills.py``: a table per configuration and every kill, with
what was compared and the machine."""

from __future__ import annotations

import os
import platform
from collections import Counter
from pathlib import Path


def write_report(results: dict, path: Path) -> None:
    rows = [
        "| configuration | kills | before first checkpoint | during checkpoint write | between checkpoints | "
        "exact resumes | starts (rounds) | slowest exit of all processes | run time |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        L = r["landed"]
        rows.append(
            f"| {name} | {r['kills']} | {L.get('before first checkpoint', 0)} | {L.get('during checkpoint write', 0)} | "
            f"{L.get('between checkpoints', 0)} | **{r['exact']}/{r['kills']}** | {r['starts']} ({r['rounds']}) | "
            f"{r['max_leftover_s']:.1f} s | {r['seconds'] / 60:.1f} min (reference {r['reference_s']:.0f} s) |"
        )
    excluded = sorted({k for r in results.values() for k in r["excluded"]})
    points = Counter(
        k["detail"].split(" of ")[0] for r in results.values() for k in r["kill_list"] if k["kind"] == "pause"
    )
    text = f"""# Kills at random moments (`benchmarks/random_kills.py`)

Each configuration: the tiny preset, {next(iter(results.values()))['steps']} steps, a checkpoint every
{next(iter(results.values()))['save_freq']} steps, run once uninterrupted, then SIGKILLed (the driver's
process group) at seeded random moments and restarted with the same command after each kill,
until the run completes (once the last step's checkpoint is written, the next start is left to
complete: it has no step to do, and a kill there would test only the exit; further kills go to a
new round in a fresh folder). A resume is exact when every record that the run after it left
(`metrics.jsonl`, `timeline.jsonl`, `samples.jsonl`) equals the uninterrupted run's, with no step
missing or repeated, and no process of the killed run is left. Each row's command (from the
checkout's root, with `.venv/bin/python`):

{chr(10).join(f"    {r.get('command', '?')}" for r in results.values())}

{chr(10).join(rows)}

CPU and date of each configuration's run: {
        '; '.join(f"{n}: {r.get('cpu', 'not recorded')}, {r.get('date', 'not recorded')}" for n, r in results.items())
    }.

Compared: every field of every metrics record except these wall-clock ones: {', '.join(f'`{k}`' for k in excluded)};
every timeline event's role, stage, step and other fields except `start`/`end`; every sample row
in full. Kills paused inside a checkpoint write on purpose (`tests/kill_points.py`), by point:
{', '.join(f'{p} {n}' for p, n in sorted(points.items()))}. "Slowest exit": the longest a kill's Ray workers took to end
on their own once the driver's process group was gone (they are in their own process groups).

Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other sessions'
work (one configuration at a time under the shared lock; others' runs waited, but editors and
light jobs did not), so the times are indicative.

## Every kill

| configuration | # | drawn | moment | landed | at | gone in | resumed | exact |
|---|---|---|---|---|---|---|---|---|
"""
    for name, r in results.items():
        for i, k in enumerate(r["kill_list"], 1):
            text += (
                f"| {name} | {i} | {k['kind']} | {k['detail']} | {k['landed']} | {k['at']} | {k['leftover_s']:.1f} s | "
                f"{k['resumed']} | {'yes' if k['exact'] else 'NO: ' + '; '.join(k['problems'] + k['leftovers'])[:200]} |\n"
            )
    path.write_text(text)
