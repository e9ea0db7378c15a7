"""What a run leaves in its output directory: ``metrics.jsonl`` (one object per step) and
``timeline.jsonl`` (one event per stage: role, stage, step, start, end; seconds since the run
started), from which the overlap of generation and training can be read."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from offstep.errors import RunFileError
from offstep.files import loads_json, open_record, read_text, write_file


def _clean(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class JsonlWriter:
    def __init__(self, path: Path, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open_record(self.path, append)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def close(self) -> None:
        self._f.close()


class Timeline:
    """Stage events on one clock (``time.time()``), stored relative to the run's start."""

    def __init__(self, path: Path, t0: float | None = None, append: bool = False):
        self.t0 = time.time() if t0 is None else t0
        self._out = JsonlWriter(path, append=append)

    def add(self, role: str, stage: str, step: int, start: float, end: float, **extra) -> None:
        ev = {
            "role": role,
            "stage": stage,
            "step": step,
            "start": round(start - self.t0, 4),
            "end": round(end - self.t0, 4),
            **extra,
        }
        self._out.write(ev)

    def close(self) -> None:
        self._out.close()


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSONL file; ``ValueError`` naming the line that is not a JSON object."""
    records = []
    for n, line in enumerate(read_text(path).splitlines(), start=1):
        if line.strip():
            try:
                record = loads_json(line)
            except ValueError as e:
                raise RunFileError(f"{path}: line {n} cannot be read ({e})") from None
            if not isinstance(record, dict):
                raise RunFileError(f"{path}: line {n} is a JSON {type(record).__name__}, not an object")
            records.append(record)
    return records


def truncate_jsonl(path: str | Path, max_step: int) -> None:
    """Drop the records of steps after ``max_step`` (a resumed run rewrites them).

    A torn last line (the run crashed while writing it) is dropped with a warning; a line that is
    not a JSON object anywhere else means the file was damaged, and is an error naming the line."""
    import logging

    from offstep.errors import OffstepError

    path = Path(path)
    if not path.exists():
        return
    lines = [(n, line) for n, line in enumerate(read_text(path).splitlines(), start=1) if line.strip()]
    keep = []
    for i, (n, line) in enumerate(lines):
        try:
            record = loads_json(line)
            if not isinstance(record, dict):
                raise ValueError(f"a JSON {type(record).__name__}, not an object")
        except ValueError as exc:  # json.JSONDecodeError is a ValueError
            if i == len(lines) - 1:
                logging.getLogger(__name__).warning(
                    "%s: dropped its last line %d, cut off mid-write by the run that stopped (%s)", path, n, exc
                )
                break
            raise OffstepError(
                f"{path}: line {n} is not a JSON object ({exc}), and it is not the last line, so the file was "
                f"damaged after it was written. Fix: delete or repair that line, or move the file away to "
                f"resume without the earlier records"
            ) from None
        if record.get("step", 0) <= max_step:
            keep.append(line + "\n")
    # Into a new file that replaces the old one: a kill during the rewrite (the resumed run's
    # start) leaves the old records or the kept ones, never a half-written file.
    write_file(path, "".join(keep))
