"""The record of a process's sandbox executions, drained once per generation call and summed
into a step's ``sandbox/`` metrics (``offstep.telemetry.names.SandboxMetrics``)."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Execution:
    seconds: float  # from start to the end of the sandbox (queueing not included)
    queue_wait_s: float  # waiting for a free slot (Sandbox.concurrency)
    timed_out: bool


class SandboxLog:
    """Executions recorded by any thread, taken out all at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._runs: list[Execution] = []

    def add(self, run: Execution) -> None:
        with self._lock:
            self._runs.append(run)

    def drain(self) -> tuple[Execution, ...]:
        with self._lock:
            runs, self._runs = tuple(self._runs), []
        return runs
