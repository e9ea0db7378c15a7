"""The processes of ``benchmarks/random_kills.py``'s runs: starting the command in a session of its
own (or held at a checkpoint phase, ``tests/kill_points.py``), and waiting for every process of a
killed one to be gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks.common import ROOT

LEFTOVER_S = 30.0  # Ray's workers end when their raylet is gone (a few seconds here)
KILL_POINTS = ROOT / "tests" / "kill_points.py"  # offstep with the driver held at a checkpoint phase


def spawn(args: list[str], env: dict, log: Path, pause: str | None = None) -> subprocess.Popen:
    entry = [str(KILL_POINTS), pause] if pause else ["-m", "offstep.cli"]
    return subprocess.Popen(
        [sys.executable, *entry, "train", *args],
        cwd=ROOT,
        start_new_session=True,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env=env,
    )


def count_lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def alive(pids) -> list[str]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            pass
    return out


def session_pids(sid: int) -> set[int]:
    found = subprocess.run(["pgrep", "-s", str(sid)], capture_output=True, text=True).stdout.split()
    return {int(p) for p in found}


def wait_gone(sid: int, seen: set[int]) -> tuple[float, list[str]]:
    """Seconds until no process of session ``sid`` nor of ``seen`` is alive; what was left after
    ``LEFTOVER_S`` (then killed, so that the next run starts clean)."""
    t0 = time.time()
    while time.time() - t0 < LEFTOVER_S:
        left = alive(session_pids(sid) | seen)
        if not left:
            return time.time() - t0, []
        time.sleep(0.1)
    left = alive(session_pids(sid) | seen)
    for entry in left:
        try:
            os.kill(int(entry.split()[0]), signal.SIGKILL)
        except OSError:
            pass
    return time.time() - t0, left
