"""The limits of one sandboxed execution, and the interpreter's first lines that apply them.

The whole sandbox's memory (``memory_mb`` + ``tmp_mb``) and processes are bounded by a cgroup of
its own where one can be made (``offstep.sandbox.cgroup``). The rlimits are set inside the
sandbox, on the process that then runs the code, so that they bind the untrusted process tree
only (not bwrap). ``RLIMIT_NPROC`` counts per user namespace: each sandbox has its own, so the
limit is per execution, not shared by concurrent ones. It does not bind uid 0 of the first
namespace, which is why a root caller runs bwrap as ``nobody`` (``offstep.sandbox.bwrap``).

Without a cgroup, ``RLIMIT_AS`` is per process: the tree then gets at most ``FALLBACK_PROCESSES``
processes (threads and the sandbox's init included) of ``memory_mb / FALLBACK_PROCESSES`` each
(at least ``FALLBACK_MIN_MB``), so that their address spaces together stay within ``memory_mb``.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
FALLBACK_PROCESSES = 4  # without a cgroup: processes x address space <= memory_mb (or 4 x FALLBACK_MIN_MB)
FALLBACK_MIN_MB = 64  # an interpreter starts in 48 MB of address space


@dataclass(frozen=True)
class Limits:
    """What one execution may use. Every field is a hard limit the code cannot raise."""

    timeout_s: float = 10.0  # wall clock; the whole process tree is killed past it
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU; SIGXCPU, then SIGKILL)
    memory_mb: int = 1024  # the whole sandbox (cgroup), its tmpfs aside; each process's address space (RLIMIT_AS)
    processes: int = 32  # processes and threads (pids cgroup, RLIMIT_NPROC), the sandbox's init included
    file_mb: int = 16  # largest file written (RLIMIT_FSIZE)
    open_files: int = 64  # open file descriptors (RLIMIT_NOFILE)
    tmp_mb: int = 64  # the private tmpfs, all files together
    output_bytes: int = 1 << 20  # stdout and stderr together, counted while reading; past it the tree is killed

    @classmethod
    def of(cls, config) -> "Limits":
        """The limits of an object with fields of the same names (the ``sandbox`` config)."""
        return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__})

    def check(self) -> list[str]:
        """What is out of range, one message per field (empty: usable)."""
        bad = [
            f"{k}={getattr(self, k)!r} must be positive" for k in self.__dataclass_fields__ if not getattr(self, k) > 0
        ]
        if self.processes < 4:
            bad.append(f"processes={self.processes} is too few for an interpreter and the sandbox's init (at least 4)")
        if self.open_files < 16:
            bad.append(f"open_files={self.open_files} is too few for an interpreter (at least 16)")
        if self.memory_mb < 64:
            bad.append(f"memory_mb={self.memory_mb} is too little for an interpreter (at least 64)")
        return bad

    def cgroup_bytes(self) -> int:
        """The memory limit of the sandbox's cgroup: its processes' and its tmpfs files'."""
        return (int(self.memory_mb) + int(self.tmp_mb)) * MIB

    def rlimits(self, whole_tree: bool = True) -> dict[str, int]:
        """The ``resource`` module's names and values; ``whole_tree=False`` where no cgroup bounds
        the sandbox as a whole (the per-process share above)."""
        processes, memory_mb = int(self.processes), int(self.memory_mb)
        if not whole_tree:
            processes = min(processes, FALLBACK_PROCESSES)
            memory_mb = max(memory_mb // processes, FALLBACK_MIN_MB)
        return {
            "RLIMIT_CPU": int(self.cpu_s),
            "RLIMIT_AS": memory_mb * MIB,
            "RLIMIT_NPROC": processes,
            "RLIMIT_FSIZE": int(self.file_mb) * MIB,
            "RLIMIT_NOFILE": int(self.open_files),
            "RLIMIT_CORE": 0,
        }


def bootstrap(limits: Limits, python: str, script: str, whole_tree: bool = True) -> list[str]:
    """The command run inside the sandbox: an interpreter without site packages sets the limits,
    then replaces itself (``execv``) with ``python -I script``, so the code's tracebacks show its
    own frames only and the limits are inherited by everything it starts."""
    # RLIMIT_CPU's hard limit a second above the soft one: SIGXCPU first (the result names the limit), SIGKILL after
    sets = ";".join(
        f"r.setrlimit(r.{name},({value},{value + (name == 'RLIMIT_CPU')}))"
        for name, value in limits.rlimits(whole_tree).items()
    )
    code = f"import os,resource as r;{sets};os.execv({python!r},[{python!r},'-I',{script!r}])"
    return [python, "-I", "-S", "-c", code]
