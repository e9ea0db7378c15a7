"""Starting one sandbox: its cgroup, its seccomp filter, and a reaper around bwrap; and the
probe that says whether a sandbox starts here at all.

The order: make the cgroup (``offstep.sandbox.cgroup``), start bwrap, read the PID of the
sandbox's first process from ``--info-fd``, move it into the cgroup, then release it through
``--block-fd``: nothing inside runs before it is in the group, and what it starts inherits it.

The reaper: bwrap's outer process exits as soon as the code's exit status arrives from the
sandbox's init (PID 1 inside, which reaps inside), without waiting for that init: the init is
then an orphan, and under a PID 1 that does not reap (a container without ``--init``) a zombie
per execution. So bwrap runs as the child of a small process of ours that is a child subreaper
(``PR_SET_CHILD_SUBREAPER``): the orphaned init is reparented to it, and it waits for every
process it gets before it exits with bwrap's status. We wait for the reaper on every path.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

from offstep.sandbox import seccomp
from offstep.sandbox.bwrap import BWRAP_ENV, INSTALL, SYSTEM_PYTHON, code_file, command, run_as
from offstep.sandbox.cgroup import Group, warn_once
from offstep.sandbox.limits import Limits

# argv: our pid, the fds to close once bwrap has them, bwrap's argv. PR_SET_CHILD_SUBREAPER is 36,
# PR_SET_PDEATHSIG 1 (dies with us; bwrap's --die-with-parent then takes the sandbox along).
REAPER = """import ctypes, os, sys
libc = ctypes.CDLL(None)
libc.prctl(36, 1, 0, 0, 0)
libc.prctl(1, 9, 0, 0, 0)
if os.getppid() != int(sys.argv[1]):
    os._exit(125)
child = os.fork()
if child == 0:
    os.execv(sys.argv[3], sys.argv[3:])
for fd in [0, 1, 2] + [int(f) for f in sys.argv[2].split(',')]:
    os.close(fd)
code = 125
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    if pid == child:
        code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot start a sandbox; nothing runs unsandboxed instead."""


@dataclass
class Started:
    """A running sandbox: the reaper (our child), the outside PID of the sandbox's init (None if
    bwrap failed before saying it) and its cgroup (None: per-process limits only)."""

    proc: subprocess.Popen
    child: int | None
    group: Group | None

    def kill(self) -> None:
        """SIGKILL the sandbox's init, which ends every process of its PID namespace; before bwrap
        has said that PID, the reaper's process group (``--die-with-parent`` does the rest)."""
        try:
            if self.child is not None:
                os.kill(self.child, signal.SIGKILL)
            else:
                os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def finish(self) -> None:
        """Wait for the reaper (and so for bwrap and the init), then kill what is left in the
        cgroup and remove it."""
        if self.proc.poll() is None:
            self.kill()
            self.proc.wait()
        if self.group is not None:
            self.group.close()


def _filter(whole_tree: bool) -> int | None:
    try:
        return code_file(seccomp.program(bounded_memory=whole_tree))
    except ValueError as exc:
        warn_once(f"no seccomp filter: {exc}")
        return None


def start(limits: Limits, python: str, code: str, bwrap: str, **popen) -> Started:
    """Start a sandbox running ``code`` (``popen``: the pipes); returns once it runs the code."""
    group = Group.create(limits.cgroup_bytes(), limits.processes)
    code_fd, seccomp_fd = code_file(code), _filter(group is not None)
    info_r, info_w = os.pipe()
    block_r, block_w = os.pipe()
    passed = [fd for fd in (code_fd, info_w, block_r, seccomp_fd) if fd is not None]
    argv = command(limits, python, code_fd, info_w, bwrap, block_r, seccomp_fd, group is not None)
    try:
        proc = subprocess.Popen(
            [python, "-I", "-S", "-c", REAPER, str(os.getpid()), ",".join(map(str, passed)), *argv],
            pass_fds=passed,
            start_new_session=True,
            env=BWRAP_ENV,
            **run_as(),
            **popen,
        )
    except BaseException:
        for fd in (info_r, block_w):
            os.close(fd)
        if group is not None:
            group.close()
        raise
    finally:
        for fd in passed:
            os.close(fd)
    started = Started(proc, None, group)
    try:
        started.child = _child_pid(_read_all(info_r, time.monotonic() + max(limits.timeout_s, 10.0)))
        if started.child is None:
            started.kill()  # bwrap failed (its stderr says why) or hangs: never release it unbounded
        else:
            if group is not None:
                group.add(started.child)
            try:
                os.write(block_w, b"1")
            except BrokenPipeError:  # bwrap is gone already; its exit status says why
                pass
    except BaseException as exc:
        started.finish()
        if isinstance(exc, OSError):
            raise SandboxUnavailable(f"cannot move the sandbox into its cgroup: {exc}") from exc
        raise
    finally:
        os.close(block_w)
        os.close(info_r)
    return started


def _read_all(fd: int, deadline: float) -> bytes:
    """What is written to ``fd`` until it is closed, or until ``deadline``."""
    data = bytearray()
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            data += chunk
    return bytes(data)


def _child_pid(info: bytes) -> int | None:
    try:
        return int(json.loads(info)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


def problem(python: str = SYSTEM_PYTHON, bwrap: str = "bwrap") -> str | None:
    """Why code cannot be sandboxed here (None: it can): bwrap missing, failing (no user
    namespaces), or the interpreter missing. Runs ``print(1)`` in a sandbox once."""
    path = shutil.which(bwrap)
    if path is None:
        return f"the sandbox needs bubblewrap (bwrap), which is not installed: {INSTALL}"
    if not python.startswith("/usr/") or not os.path.isfile(python):
        return f"the sandbox's interpreter {python} is not a file under /usr (the only tree bound into the sandbox)"
    try:
        started = start(
            Limits(),
            python,
            "print(1)\n",
            path,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            out, err = started.proc.communicate(timeout=30)
        finally:
            started.finish()
    except (OSError, subprocess.SubprocessError, SandboxUnavailable) as exc:
        return f"bubblewrap ({path}) could not run a sandbox: {exc}"
    if started.proc.returncode != 0 or out.strip() != b"1":
        why = err.decode(errors="replace").strip()[-300:] or f"exit status {started.proc.returncode}"
        return (
            f"bubblewrap ({path}) is installed but cannot start a sandbox here ({why}); it needs user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1 or user.max_user_namespaces > 0)"
        )
    return None
