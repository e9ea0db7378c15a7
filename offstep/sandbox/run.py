"""Run untrusted Python code in a bubblewrap sandbox (``offstep.sandbox.bwrap``) with limits
(``offstep.sandbox.limits``), and say what happened.

Output is counted as it is read: past ``Limits.output_bytes`` the sandbox is killed, so a flood
costs at most that much memory. The wall clock kills the sandbox's PID-namespace init, which
takes every process of the namespace with it (daemons, double forks, zombies); bwrap and the
reaper around it (``offstep.sandbox.launch``) then exit and are waited for, and the cgroup is
emptied and removed, so nothing outlives an execution. A ``Sandbox`` lets at most
``concurrency`` executions run at once; the others wait, and the wait is measured.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from offstep.sandbox.bwrap import INSTALL, SYSTEM_PYTHON
from offstep.sandbox.launch import SandboxUnavailable, start
from offstep.sandbox.limits import MIB, Limits
from offstep.sandbox.stats import Execution, SandboxLog

_SIGNAL_LIMITS = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}


@dataclass(frozen=True)
class Result:
    """One execution. ``exit_code``: the code's exit status, negative for a signal (-9: killed),
    None when it was killed by the sandbox; ``limit``: the limit that stopped it (``timeout``,
    ``output``, ``cpu``, ``memory``, ``file_size``, ``processes``) or None."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    limit: str | None
    seconds: float
    queue_wait_s: float
    truncated: bool = False  # output past Limits.output_bytes was dropped
    memory_peak_mb: float | None = None  # the most the sandbox's cgroup held (None: no cgroup)

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and self.limit is None

    def describe(self) -> str:
        """One line for a model or a log: how it ended."""
        if self.timed_out:
            return f"killed: ran past the time limit ({self.seconds:.1f} s)"
        if self.limit is not None:
            return f"stopped by the {self.limit} limit (exit status {self.exit_code})"
        return f"exit status {self.exit_code}"


class Sandbox:
    """Executions under ``limits``, at most ``concurrency`` at a time; each is recorded in ``log``."""

    def __init__(
        self,
        limits: Limits = Limits(),
        concurrency: int = 2,
        python: str = SYSTEM_PYTHON,
        log: SandboxLog | None = None,
    ):
        bad = limits.check() + ([] if concurrency >= 1 else [f"concurrency={concurrency} must be at least 1"])
        if bad:
            raise ValueError("sandbox limits: " + "; ".join(bad))
        self.limits, self.python, self.concurrency = limits, python, concurrency
        self._slots = threading.BoundedSemaphore(concurrency)
        self.log = log if log is not None else SandboxLog()

    def run(self, code: str, stdin: str | bytes = b"") -> Result:
        """Run ``code`` as a script with ``stdin``; never raises for what the code does. Raises
        :class:`SandboxUnavailable` when bwrap is not installed."""
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise SandboxUnavailable(f"cannot run code: {INSTALL}")
        data = stdin.encode("utf-8", errors="surrogateescape") if isinstance(stdin, str) else bytes(stdin)
        t0 = time.monotonic()
        with self._slots:
            waited = time.monotonic() - t0
            result = self._execute(bwrap, code, data, waited)
        self.log.add(Execution(result.seconds, result.queue_wait_s, result.timed_out))
        return result

    def _execute(self, bwrap: str, code: str, data: bytes, waited: float) -> Result:
        lim = self.limits
        t0 = time.monotonic()
        started = start(
            lim, self.python, code, bwrap, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        proc = started.proc
        feeder = threading.Thread(target=_feed, args=(proc.stdin, data), daemon=True, name="sandbox-stdin")
        feeder.start()
        out, err = bytearray(), bytearray()
        stopped, truncated, peak, oom = None, False, None, 0
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        deadline = t0 + lim.timeout_s
        try:
            while sel.get_map():
                left = deadline - time.monotonic()
                if left <= 0:
                    stopped = "timeout"
                    break
                for key, _ in sel.select(min(left, 1.0)):
                    chunk = os.read(key.fileobj.fileno(), 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    room = lim.output_bytes - len(out) - len(err)
                    key.data.extend(chunk[: max(room, 0)])
                    if len(chunk) > room:
                        stopped, truncated = "output", True
                if stopped:
                    break
            if stopped:
                started.kill()
            try:
                status = proc.wait(max(deadline - time.monotonic(), 0.0) + 1.0)
            except subprocess.TimeoutExpired:  # the code closed its output but runs on
                stopped = stopped or "timeout"
                started.kill()
                status = proc.wait()
        finally:
            sel.close()
            for f in (proc.stdout, proc.stderr):
                f.close()
            if started.group is not None:
                peak, oom = started.group.peak(), started.group.oom_kills()
            started.finish()  # an exception of our own too: never leave the sandbox running
        seconds = time.monotonic() - t0
        feeder.join(1.0)
        stdout, stderr = out.decode("utf-8", errors="replace"), err.decode("utf-8", errors="replace")
        exit_code = None if stopped else _exit_code(status)
        limit = stopped or ("memory" if oom and exit_code else _limit_of(exit_code, stderr))
        return Result(
            stdout,
            stderr,
            exit_code,
            stopped == "timeout",
            limit,
            seconds,
            waited,
            truncated,
            None if peak is None else peak / MIB,
        )


def _feed(pipe, data: bytes) -> None:
    """Write the code's stdin and close it; a sandbox that exits without reading it is fine."""
    try:
        if data:
            pipe.write(data)
    except (BrokenPipeError, OSError, ValueError):
        pass
    finally:
        try:
            pipe.close()
        except (BrokenPipeError, OSError):
            pass


def _exit_code(status: int) -> int:
    """bwrap passes the code's exit status on; a death by signal N arrives as 128 + N."""
    return -(status - 128) if 128 < status < 160 else status


def _limit_of(exit_code: int | None, stderr: str) -> str | None:
    """The rlimit that stopped the code, from how it ended."""
    if exit_code is None or exit_code == 0:
        return None
    if exit_code < 0 and -exit_code in _SIGNAL_LIMITS:
        return _SIGNAL_LIMITS[-exit_code]
    tail = stderr[-2000:]
    if "MemoryError" in tail or "Cannot allocate memory" in tail:
        return "memory"
    if "File too large" in tail:
        return "file_size"
    if "Resource temporarily unavailable" in tail or "BlockingIOError" in tail:
        return "processes"
    return None
