"""A test hook: the driver pauses at a named point inside a checkpoint write, so that a kill can be
timed into that window on purpose (``benchmarks/random_kills.py``, ``tests/test_random_kills.py``).

    OFFSTEP_TEST_PAUSE=<point>:<step>:<marker file>

At ``point`` of the checkpoint of ``step`` the driver creates ``<marker file>`` and sleeps (for an
hour: until it is killed), holding what the write holds. The points, in the order of a write:

``staged``     the ``step_<N>.partial`` folder is made, no shard written yet
``shards``     the trainer roles' shards are written, not yet ``config.yaml`` / ``trainer_state.json``
``state``      ``trainer_state.json`` is written and everything fsynced, not yet renamed
``published``  renamed to ``step_<N>`` (its timeline entry written just before); pruning not yet done

Unset (every real run), :func:`pause_point` is one environment lookup and does nothing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "OFFSTEP_TEST_PAUSE"
POINTS = ("staged", "shards", "state", "published")


def parse(value: str) -> tuple[str, int, Path]:
    point, step, marker = value.split(":", 2)
    if point not in POINTS:
        raise ValueError(f"{ENV}={value!r}: the point must be one of {list(POINTS)}")
    return point, int(step), Path(marker)


def pause_point(point: str, step: int) -> None:
    value = os.environ.get(ENV)
    if not value:
        return
    want, want_step, marker = parse(value)
    if (want, want_step) == (point, step):
        marker.write_text(f"{point}:{step}\n")
        time.sleep(3600)
