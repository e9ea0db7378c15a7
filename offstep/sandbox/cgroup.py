"""A cgroup per sandbox execution: one memory limit for its whole process tree (anonymous memory,
its tmpfs files, SysV shared memory, memfd, kernel memory such as inodes and dentries: all are
charged to the cgroup of the process that allocates them) and one process count.

cgroup v2 is used where a delegated parent is writable with the ``memory`` controller enabled in
its ``cgroup.subtree_control``: ``OFFSTEP_SANDBOX_CGROUP=<its directory>``, or the caller's own
cgroup when it has them (a process in a non-root cgroup v2 node cannot have both, so usually the
variable). Else cgroup v1, with the ``memory`` hierarchy (and ``pids`` where mounted) below the
caller's own group, where it is writable (root in a container here). ``OFFSTEP_SANDBOX_CGROUP=off``
turns them off. Where no group can be made, ``create`` returns None and the sandbox falls back to
per-process limits (``Limits.rlimits``). The caller moves the sandbox's first process in before
the code runs (``offstep.sandbox.launch``); everything it starts inherits the group.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time

ENV = "OFFSTEP_SANDBOX_CGROUP"
PREFIX = "offstep-sandbox-"
_ids = itertools.count()
_log = logging.getLogger(__name__)
_warned: set[str] = set()


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(root, mount point, fs type, super options) of the cgroup mounts this process sees."""
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rest = left.split(), right.split()
            if len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
                found.append((fields[3], fields[4], rest[0], set(rest[2].split(","))))
    return found


def _own() -> dict[str, str]:
    """This process's cgroup path per hierarchy: ``""`` for v2, else each controller's name."""
    paths = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    return paths


def _under(root: str, mountpoint: str, path: str) -> str | None:
    """The directory of cgroup ``path`` in a mount of ``root`` (None: outside that mount)."""
    if root != "/" and not (path == root or path.startswith(root + "/")):
        return None
    rel = path[len(root) :] if root != "/" else path
    return os.path.join(mountpoint, rel.lstrip("/"))


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def parents() -> tuple[int, tuple[str, ...]] | None:
    """(version, directories to make the groups in): v2 (one directory) or v1 (memory, pids or
    ""); None where none is configured or found."""
    env = os.environ.get(ENV, "").strip()
    if env == "off":
        return None
    if env:
        return (2, (env,)) if os.path.isfile(os.path.join(env, "cgroup.subtree_control")) else None
    mounts, own = _mounts(), _own()
    for root, point, kind, _ in mounts:
        if kind == "cgroup2" and "" in own:
            d = _under(root, point, own[""])
            if d and "memory" in _read(os.path.join(d, "cgroup.subtree_control")).split():
                return 2, (d,)
    v1 = {}
    for root, point, kind, opts in mounts:
        for c in ("memory", "pids"):
            if kind == "cgroup" and c in opts and c in own and c not in v1:
                v1[c] = _under(root, point, own[c])
    if v1.get("memory") and os.access(v1["memory"], os.W_OK):
        pids = v1.get("pids") or ""
        return 1, (v1["memory"], pids if pids and os.access(pids, os.W_OK) else "")
    return None


class Group:
    """One execution's cgroup (v1: a directory in each hierarchy). ``close`` kills what is left in
    it and removes it."""

    def __init__(self, version: int, dirs: list[str]):
        self.version, self.dirs = version, dirs

    @classmethod
    def create(cls, memory_bytes: int, processes: int) -> "Group | None":
        """A new group with these limits, or None where none can be made here (said once in the log)."""
        try:
            found = parents()
        except OSError as exc:
            found = None
            warn_once(f"reading this process's cgroups failed: {exc}")
        if found is None:
            if os.environ.get(ENV, "").strip() != "off":
                warn_once("no writable cgroup: each sandbox's memory and processes are bounded per process only")
            return None
        version, bases = found
        name = f"{PREFIX}{os.getpid()}-{next(_ids)}"
        group = cls(version, [])
        try:
            for base in bases:
                if base:
                    os.mkdir(os.path.join(base, name), 0o755)
                    group.dirs.append(os.path.join(base, name))
            group._limit(memory_bytes, processes)
        except OSError as exc:
            group.close()
            warn_once(f"cannot make a cgroup under {', '.join(b for b in bases if b)}: {exc}")
            return None
        return group

    def _limit(self, memory_bytes: int, processes: int) -> None:
        m = self.dirs[0]
        if self.version == 2:
            _write(f"{m}/memory.max", str(memory_bytes))
            _optional(f"{m}/memory.swap.max", "0")
            _optional(f"{m}/memory.oom.group", "1")  # an OOM kill takes the whole sandbox
            _optional(f"{m}/pids.max", str(processes))
            return
        _write(f"{m}/memory.limit_in_bytes", str(memory_bytes))
        _optional(f"{m}/memory.memsw.limit_in_bytes", str(memory_bytes))  # memory plus swap
        for d in self.dirs[1:]:
            _write(f"{d}/pids.max", str(processes))

    def add(self, pid: int) -> None:
        """Move process ``pid`` (one thread, not yet started on the code) into the group."""
        for d in self.dirs:
            _write(f"{d}/cgroup.procs", str(pid))

    def peak(self) -> int | None:
        """The most memory the group held, in bytes (None where the kernel does not say)."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(f"{self.dirs[0]}/{name}"))
        except (OSError, ValueError, IndexError):
            return None

    def oom_kills(self) -> int:
        """Processes of the group killed for its memory limit."""
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in _read(f"{self.dirs[0]}/{name}").splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def close(self, wait_s: float = 5.0) -> None:
        """Kill every process left in the group, then remove it (v1: every hierarchy's directory)."""
        deadline = time.monotonic() + wait_s
        for d in self.dirs:
            if self.version == 2:
                _optional(f"{d}/cgroup.kill", "1")
            while True:
                try:
                    pids = [int(p) for p in _read(f"{d}/cgroup.procs").split()]
                except OSError:
                    break
                if not pids or time.monotonic() > deadline:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.01)
        for d in self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        _log.warning("sandbox cgroup %s not removed: %s", d, exc)
                        break
                    time.sleep(0.01)
        self.dirs = []


def _optional(path: str, value: str) -> None:
    """A setting some kernels lack (or refuse): the limit above it holds anyway."""
    try:
        _write(path, value)
    except OSError:
        pass


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        _log.warning("sandbox: %s (docs/sandbox.md)", message)
