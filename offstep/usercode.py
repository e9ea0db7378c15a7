"""Time limits on code offstep runs but does not own: importing a user's file, rendering a chat
template. None relies on SIGALRM alone, which the user's code can ignore or replace:

* :func:`finishes_importing` imports the file first in a fresh Python process (its own session and
  subreaper), killed with SIGKILL with everything it started if it is not done in time;
* :func:`hard_deadline` guards the import in this process that follows: past the limit it prints
  its message and ends the process (a file may hang only the second time);
* :func:`run_stoppable` runs a function in a helper thread and, when it stops making progress,
  gives up on it and raises an exception inside it (Python-level loops stop there).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

from offstep import reaper

START_S = 60.0  # for the probe's Python to start (not counted in the file's limit): a busy machine is slow


def finishes_importing(path: str, module_name: str, timeout_s: float) -> bool:
    """Whether importing ``path`` (as ``module_name``) finishes within ``timeout_s`` seconds, in
    a fresh process. How it ends (an error) is left to the real import; True where no probe can
    start."""
    env = dict(os.environ, OFFSTEP_PROBE_PATH=json.dumps(sys.path))
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from offstep.usercode import _probe; _probe()", module_name, path],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
    except OSError:
        return True
    try:
        started, _, _ = select.select([proc.stdout], [], [], START_S)
        if not started or not os.read(
            proc.stdout.fileno(), 1
        ):  # no probe (it failed to start): the real import's limits
            return True
        try:
            proc.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    finally:
        for p in [*reaper.descendants(proc.pid), proc.pid]:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


def _probe() -> None:
    """The probe process: import the file, kill what it started, exit (never waiting for a thread)."""
    import importlib.util

    module_name, path = sys.argv[1], sys.argv[2]
    sys.path[:] = json.loads(os.environ.pop("OFFSTEP_PROBE_PATH"))
    reaper.become_subreaper()  # a double-forked daemon stays below this process, to be killed
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    null = os.open(os.devnull, os.O_RDWR)
    os.write(1, b"s")  # the time limit counts from here
    os.dup2(null, 1)  # what the file prints, and its children, get no pipe to hold
    os.dup2(null, 2)
    try:
        spec.loader.exec_module(module)
    except BaseException:  # noqa: BLE001 - the real import reports it
        pass
    reaper.kill_descendants()
    os._exit(0)


@contextlib.contextmanager
def hard_deadline(seconds: float, message: str, code: int = 2) -> Iterator[None]:
    """Past ``seconds`` in the block: print ``offstep: <message>`` to stderr and end the process
    with ``code`` (no exception can be raised into a loop that ignores signals)."""
    done = threading.Event()

    def watch():
        if not done.wait(seconds):
            os.write(2, f"offstep: {message}\n".encode())
            os._exit(code)

    threading.Thread(target=watch, name="offstep-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()


class TimeLimit(Exception):
    """A function given to :func:`run_stoppable` made no progress within its limit."""

    def __init__(self, progress: Any):
        super().__init__(f"no progress past {progress!r}")
        self.progress = progress


class _Stop(BaseException):
    """Raised inside a helper thread given up on (a BaseException: no ``except Exception`` keeps it)."""


def run_stoppable(
    fn: Callable[[], Any], limit_s: float, progress: Callable[[], Any] = lambda: None, name: str = "offstep-stoppable"
) -> Any:
    """``fn()``, run in a daemon thread; :class:`TimeLimit` (with the last ``progress()``) when
    ``progress()`` has not changed for ``limit_s`` seconds, after raising an exception inside
    ``fn`` to stop it. Code that holds the interpreter in C is not stopped, but being a daemon
    thread it does not keep the process from exiting."""
    box: dict[str, Any] = {}

    def target():
        try:
            box["value"] = fn()
        except _Stop:
            pass
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            box["error"] = exc

    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    last, since = progress(), time.monotonic()
    while True:
        thread.join(min(limit_s, 0.2))
        if not thread.is_alive():
            break
        now = progress()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= limit_s:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(_Stop))
            raise TimeLimit(last)
    if "error" in box:
        raise box["error"]
    return box["value"]
