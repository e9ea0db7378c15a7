"""A launcher for the random-kill tests and benchmark: ``offstep`` with its driver held at one phase of
one checkpoint write, so that a kill can be timed into that window on purpose.

    python tests/kill_points.py <phase>:<step>:<marker file> train key=value ...

At ``phase`` (``offstep.pipeline.checkpoints.PHASES``) of the checkpoint of ``step`` the driver
creates ``<marker file>`` and sleeps for an hour (until it is killed), holding what the write holds.
The rest of the arguments go to ``offstep train`` as they are, with the hold passed through its seam
(``offstep.cli.train_command(argv, on_phase=...)``); a run started any other way has none."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from offstep.pipeline import checkpoints


def parse(spec: str) -> tuple[str, int, Path]:
    name, step, marker = spec.split(":", 2)
    if name not in checkpoints.PHASES:
        raise ValueError(f"{spec!r}: the phase must be one of {list(checkpoints.PHASES)}")
    return name, int(step), Path(marker)


def arm(spec: str):
    """The ``on_phase`` that holds the driver at the phase and step ``spec`` names (see the module's docstring)."""
    want, want_step, marker = parse(spec)

    def hold(name: str, step: int) -> None:
        if (name, step) == (want, want_step):
            part = marker.with_name(marker.name + ".part")  # whole or absent: the marker is read as soon as it exists
            part.write_text(f"{name}:{step}\n")
            part.rename(marker)
            time.sleep(3600)

    return hold


if __name__ == "__main__":
    from offstep.cli import train_command

    if sys.argv[2:3] != ["train"]:
        sys.exit("usage: python tests/kill_points.py <phase>:<step>:<marker file> train key=value ...")
    sys.exit(train_command(sys.argv[3:], on_phase=arm(sys.argv[1])))
