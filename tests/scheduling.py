"""The order in which the two pytest processes of ``scripts/test.sh`` take the test files.

pytest-xdist's ``--dist loadfile`` hands each process whole files, one at a time, in the order it
gets them; by default it puts the files with the most tests first. That is the wrong measure here: a
file of a hundred unit tests takes seconds, a file of four multi-node runs minutes, and a long file
taken last leaves the other core idle while it runs. So the files go longest first (the usual
greedy rule for two machines), each file's length taken from ``tests/durations.json`` (seconds per
file, measured) or, for a file not there, guessed from its tests' markers. ``scripts/test.sh`` passes
``--no-loadscope-reorder`` so that xdist keeps this order.

To measure again: ``OFFSTEP_TEST_TIMELINE=/tmp/timeline.jsonl bash scripts/test.sh`` records each
test's start, seconds and process; ``python -m tests.scheduling /tmp/timeline.jsonl`` then rewrites
``tests/durations.json`` and prints how long each process ran and how long the last file kept the
other one waiting.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).with_name("durations.json")
# A guess, in seconds, for a test of a file that tests/durations.json does not list, by its markers.
GUESS = (("slow", 60.0), ("vllm", 20.0), ("ray", 20.0), ("model", 20.0), ("heavy", 3.0))
GUESS_OTHER = 0.1


def _file_of(item) -> str:
    return item.nodeid.split("::", 1)[0]


def _guess(item) -> float:
    return next((s for marker, s in GUESS if item.get_closest_marker(marker)), GUESS_OTHER)


def longest_files_first(items: list) -> None:
    """Reorders ``items`` in place: whole files, the longest first; a file's own order is kept."""
    measured = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    guessed: dict[str, float] = defaultdict(float)
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        f = _file_of(item)
        guessed[f] += _guess(item)
        first.setdefault(f, i)
    length = {f: measured.get(f, g) for f, g in guessed.items()}
    items.sort(key=lambda item: (-length[_file_of(item)], first[_file_of(item)]))


def record(report, path: str) -> None:
    """One line per test phase to ``path`` (``OFFSTEP_TEST_TIMELINE``): process, test, phase, start
    and seconds. Lines are short and appended whole, so the two processes can share the file."""
    line = {
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "test": report.nodeid,
        "phase": report.when,
        "start": round(report.start, 3),
        "seconds": round(report.duration, 3),
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def summarize(timeline: Path) -> dict[str, float]:
    """Seconds per file from a timeline; prints each process's span and the last file's wait."""
    lines = [json.loads(x) for x in timeline.read_text().splitlines() if x.strip()]
    per_file: dict[str, float] = defaultdict(float)
    span: dict[str, list[float]] = {}
    for x in lines:
        per_file[x["test"].split("::", 1)[0]] += x["seconds"]
        s = span.setdefault(x["worker"], [x["start"], x["start"]])
        s[0], s[1] = min(s[0], x["start"]), max(s[1], x["start"] + x["seconds"])
    for worker, (a, b) in sorted(span.items()):
        print(
            f"{worker}: {b - a:.0f} s ({time.strftime('%H:%M:%S', time.localtime(a))} to {time.strftime('%H:%M:%S', time.localtime(b))})"
        )
    if len(span) > 1:
        ends = sorted(b for _, b in span.values())
        print(f"the last process ran on alone for {ends[-1] - ends[-2]:.0f} s")
    return dict(sorted(per_file.items(), key=lambda kv: -kv[1]))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m tests.scheduling TIMELINE.jsonl (written with OFFSTEP_TEST_TIMELINE=...)")
    files = summarize(Path(sys.argv[1]))
    DURATIONS.write_text(json.dumps({f: round(s, 1) for f, s in files.items()}, indent=1) + "\n")
    print(f"wrote {DURATIONS} ({len(files)} files, {sum(files.values()) / 60:.1f} min in all)")
