"""The processes and threads a user's file leaves behind, ended with the command.

A reward, tool or agent file runs in offstep's processes and may start what outlives its call: a
non-daemon thread (the interpreter waits for it at exit, forever), a child, or a daemon that
forks twice and leaves its session (re-parented to init, it would outlive the run). The command
(``offstep train`` / ``eval``) makes its process a child subreaper, so every orphan of its process
tree, Ray workers' included, is re-parented to it rather than to init; at exit, after Ray's own
shutdown, it kills every descendant left and does not wait for stray threads.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int | None = None) -> list[int]:
    """Every process below ``pid`` (default: this one), read from /proc (empty where there is none)."""
    root = os.getpid() if pid is None else pid
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rfind(b")") + 2 :].split()  # after "pid (comm)": the comm may hold spaces
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], list(children.get(root, []))
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def kill_descendants(pid: int | None = None, rounds: int = 5) -> int:
    """SIGKILL every process below ``pid`` (default: this one), again while new ones appear (a
    process may fork while its siblings are killed); reap this process's zombies. Returns how many."""
    killed: set[int] = set()
    for _ in range(rounds):
        left = [p for p in descendants(pid) if p not in killed]
        if not left:
            break
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
                killed.add(p)
            except OSError:
                pass
    deadline = time.monotonic() + 2.0
    while any(map(running, killed)) and time.monotonic() < deadline:  # SIGKILL lands asynchronously
        if pid is None:
            _reap()
        time.sleep(0.01)
    if pid is None:
        _reap()
    return len(killed)


def running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 :][:1] not in (b"Z", b"X")


def _reap() -> None:
    while True:
        try:
            done, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if done == 0:
            return


def guard_command() -> None:
    """At the start of a command: orphans come to this process, and at exit (the last exit
    handler, after Ray's and the loggers') every descendant left is killed."""
    become_subreaper()
    atexit.register(kill_descendants)


def stray_threads() -> list[threading.Thread]:
    """Live non-daemon threads besides the main one: the interpreter would wait for them at exit."""
    main = threading.main_thread()
    return [t for t in threading.enumerate() if t is not main and t.is_alive() and not t.daemon]


def end_command(rc: int) -> int:
    """At the end of a command: Ray shut down, then, if a thread would hold up the exit, the exit
    handlers run and the process ends now with ``rc``; else ``rc`` is returned for a normal exit."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    stray = stray_threads()
    if not stray:
        return rc
    # A thread pool's idle workers (the scorers', the tools') would end at a normal exit: not named.
    from concurrent.futures import thread as pool_threads

    pooled = set(getattr(pool_threads, "_threads_queues", {}))
    named = [t for t in stray if t not in pooled]
    if named:
        names = ", ".join(repr(t.name) for t in named[:5])
        print(
            f"offstep: not waiting for {len(named)} thread(s) still running at exit ({names}): threads started by "
            "a reward, tool or agent file end with the command (start them with daemon=True)",
            file=sys.stderr,
        )
    atexit._run_exitfuncs()  # Ray's, the loggers' and kill_descendants: what a normal exit runs
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(rc)
