"""A run's metrics per step without what depends on the clock: what two runs that must be the same
run (resumed, replayed, on other nodes) are compared on."""

from __future__ import annotations

import json
from pathlib import Path

from offstep.pipeline.sample_stream import WHEN_FINISHED


def step_records(run: Path) -> dict[int, dict]:
    """Per step, everything but wall-clock figures (timing_s/, perf/, and seconds such as
    agent/tool_time_s) and ``WHEN_FINISHED``."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        out[m["step"]] = {
            k: v
            for k, v in m.items()
            if not (k.startswith(("timing_s/", "perf/")) or k.endswith("_s") or k in WHEN_FINISHED)
        }
    return out
