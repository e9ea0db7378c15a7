"""The record of a process's sandbox executions, drained once per generation call and summed
into a step's ``sandbox/`` metrics (``offstep.telemetry.names.Sandbox``)."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

KEPT = 100_000  # executions held between two drains at most (the oldest go first)


@dataclass(frozen=True)
class Execution:
    seconds: float  # from start to the end of the sandbox (queueing not included)
    queue_wait_s: float  # waiting for a free slot (Sandbox.concurrency)
    timed_out: bool


class SandboxLog:
    """Executions recorded by any thread, taken out all at once; bounded, for a process that
    nobody drains (a replica of the fully asynchronous mode, whose groups carry no timing)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._runs: deque[Execution] = deque(maxlen=KEPT)

    def add(self, run: Execution) -> None:
        with self._lock:
            self._runs.append(run)

    def drain(self) -> tuple[Execution, ...]:
        with self._lock:
            runs = tuple(self._runs)
            self._runs.clear()
        return runs
