"""The bubblewrap command line of a sandbox, and the probe that says whether it works here.

What the code sees: ``/usr`` (with the ``/bin``, ``/lib*`` links of a merged-/usr system) and two
files of ``/etc`` read-only, fresh ``/proc`` and ``/dev`` (read-only: no ``/dev/shm``), and a
private tmpfs at ``/tmp`` of ``Limits.tmp_mb`` (its only writable place, also its home and working
folder); the sandbox's own root is remounted read-only. Not the caller's home, ``/root``,
``/work``, the run folder or the checkpoints: nothing is bound that is not listed here. Every
namespace is new (``--unshare-all``: user, PID, network with only a loopback of its own, IPC,
UTS, cgroup), nested user namespaces are refused, the environment is cleared to a few variables,
and the code runs in a new session (no terminal to push input into).

The interpreter is the system's (``/usr/bin/python3``), not the virtual environment's: the
latter lives under the user's home (here ``/root/.pyenv``), which would have to be bound and so
shown, and the code needs the standard library only.

A root caller runs bwrap as ``nobody`` (65534): ``RLIMIT_NPROC`` does not bind uid 0, and files
readable by root alone stay unreadable even if something were bound by mistake.
"""

from __future__ import annotations

import os

from offstep.sandbox.limits import Limits, bootstrap

NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
SCRIPT = "/tmp/main.py"
ENV = {
    "PATH": "/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
}
# bwrap's own environment: its init (PID 1 inside) keeps it, readable there as /proc/1/environ, so the
# caller's (tokens, paths) must never reach it
BWRAP_ENV = {"PATH": "/usr/bin:/bin"}
INSTALL = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; scripts/setup.sh does it as root)"


def command(
    limits: Limits,
    python: str,
    code_fd: int,
    info_fd: int,
    bwrap: str = "bwrap",
    block_fd: int | None = None,
    seccomp_fd: int | None = None,
    whole_tree: bool = True,
) -> list[str]:
    """bwrap's argument list: the code is read from ``code_fd`` into ``/tmp/main.py``; bwrap writes
    the sandbox's PID (as seen from outside) to ``info_fd`` as JSON, then waits for a byte on
    ``block_fd`` before it starts anything inside (so that the caller can move that PID into a
    cgroup first); ``seccomp_fd`` holds the filter (``offstep.sandbox.seccomp``); ``whole_tree``:
    whether a cgroup bounds the sandbox (else the rlimits' per-process share)."""
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    for link in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        target = os.path.join("/", link)
        if os.path.islink(target):  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(target), target]
        elif os.path.isdir(target):
            args += ["--ro-bind", target, target]
    for f in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", f, f]
    args += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(limits.tmp_mb << 20),
        "--tmpfs",
        "/tmp",
        "--file",
        str(code_fd),
        SCRIPT,
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        "/tmp",
        "--clearenv",
    ]
    for k, v in ENV.items():
        args += ["--setenv", k, v]
    args += ["--info-fd", str(info_fd)]
    if block_fd is not None:
        args += ["--block-fd", str(block_fd)]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    return args + ["--", *bootstrap(limits, python, SCRIPT, whole_tree)]


def code_file(code: str | bytes) -> int:
    """A file descriptor of an anonymous in-memory file holding ``code`` (or the seccomp filter),
    at offset 0 (bwrap reads it; a pipe would block on code larger than its buffer)."""
    fd = os.memfd_create("offstep-sandbox-code", os.MFD_CLOEXEC)
    os.write(fd, code if isinstance(code, bytes) else code.encode("utf-8", errors="surrogateescape"))
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def run_as() -> dict:
    """``subprocess.Popen``'s user arguments: ``nobody`` for a root caller, else the caller."""
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}
