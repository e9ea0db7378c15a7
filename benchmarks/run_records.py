"""A run folder's records against a reference run's (``benchmarks/random_kills.py``): every metric
except wall-clock figures, every timeline event except its clock, every sample row; none repeated,
none missing where a later record shows the run got past them, and no torn line in a finished run.
Also what a run folder shows of its checkpoints: complete ones, and writes under way."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from offstep.pipeline.sample_stream import WHEN_FINISHED

# Wall-clock figures, the only fields of a metrics record not compared: their prefixes, and the
# names ending in "_s" (seconds: agent/tool_time_s); and the fully asynchronous stream's WHEN_FINISHED.
EXCLUDED_PREFIXES = ("timing_s/", "perf/")
EXCLUDED_SUFFIX = "_s"
TIMELINE_CLOCK = ("start", "end")  # a timeline event's times; role, stage, step and the rest compared


def deterministic(m: dict) -> dict:
    return {
        k: v
        for k, v in m.items()
        if not (k.startswith(EXCLUDED_PREFIXES) or k.endswith(EXCLUDED_SUFFIX) or k in WHEN_FINISHED)
    }


def read_lines(path: Path) -> tuple[list[dict], bool]:
    """The records of a JSONL file, and whether its last line was torn (cut off by a kill)."""
    if not path.exists():
        return [], False
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except ValueError:
            if i == len(lines) - 1:
                return out, True
            raise
    return out, False


@dataclass
class Records:
    """What a run folder holds, keyed by step: metrics, timeline events, sample rows."""

    metrics: list[dict]
    timeline: dict[int, Counter]
    samples: dict[int, Counter]
    torn: list[str]

    @classmethod
    def read(cls, run: Path) -> Records:
        metrics, t1 = read_lines(run / "metrics.jsonl")
        events, t2 = read_lines(run / "timeline.jsonl")
        rows, t3 = read_lines(run / "samples.jsonl")
        timeline: dict[int, Counter] = {}
        for e in events:
            key = json.dumps({k: v for k, v in e.items() if k not in TIMELINE_CLOCK}, sort_keys=True)
            timeline.setdefault(e["step"], Counter())[key] += 1
        samples: dict[int, Counter] = {}
        for r in rows:
            samples.setdefault(r["step"], Counter())[json.dumps(r, sort_keys=True)] += 1
        torn = [n for n, t in zip(("metrics.jsonl", "timeline.jsonl", "samples.jsonl"), (t1, t2, t3)) if t]
        return cls([deterministic(m) for m in metrics], timeline, samples, torn)


def check_records(run: Records, ref: Records, final: bool) -> list[str]:
    """What in ``run`` differs from the reference ``ref``. ``final``: the run completed, so every
    record must be there. Otherwise (a run just killed) the records so far: metrics of steps
    1..m, each once and equal to the reference's; timeline events and sample rows of every step at
    most the reference's (none repeated), and all of them for the steps a later record covers
    (events of step m may still follow: its checkpoint's; rows up to m are written first)."""
    problems = []
    steps = [m["step"] for m in run.metrics]
    want = [m["step"] for m in ref.metrics]
    m = len(steps)
    if steps != want[:m] or (final and steps != want):
        problems.append(f"metrics.jsonl has steps {steps}, the reference {want}")
    ref_by_step = {r["step"]: r for r in ref.metrics}
    for rec in run.metrics:
        other = ref_by_step.get(rec["step"])
        if other is not None and rec != other:
            diff = sorted(k for k in set(rec) | set(other) if rec.get(k) != other.get(k))
            problems.append(f"step {rec['step']}'s metrics differ: {diff[:8]}")
    last = steps[-1] if steps else 0
    for name, got, exp, complete_to in (
        ("timeline.jsonl", run.timeline, ref.timeline, last - 1),
        ("samples.jsonl", run.samples, ref.samples, last),
    ):
        for step in sorted(set(got) | set(exp)):
            g, e = got.get(step, Counter()), exp.get(step, Counter())
            extra, missing = g - e, e - g
            if extra:
                problems.append(
                    f"{name}: step {step} has {sum(extra.values())} record(s) the reference does not "
                    f"(repeated or different): {list(extra)[:2]}"
                )
            if missing and (final or step <= complete_to):
                problems.append(f"{name}: step {step} lacks {sum(missing.values())} record(s): {list(missing)[:2]}")
    if final and run.torn:
        problems.append(f"torn last lines in {run.torn}")
    return problems


def partial_writes(run: Path) -> set[tuple]:
    """The ``.partial`` folders there now, told apart by inode and change time (a new one: a
    write begun since)."""
    found = set()
    for p in (run / "checkpoints").glob("*.partial"):
        try:
            st = p.stat()
        except OSError:  # removed meanwhile
            continue
        found.add((p.name, st.st_ino, st.st_ctime_ns))
    return found


def checkpoint_steps(run: Path) -> list[int]:
    """The steps of the complete checkpoints in the run folder now."""
    root = run / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(
        int(p.name[5:])
        for p in root.iterdir()
        if p.name.startswith("step_") and p.name[5:].isdigit() and (p / "trainer_state.json").is_file()
    )
