"""The seccomp filter bwrap installs (``--seccomp FD``) before the code runs: a classic BPF program,
built here because it is small and fixed (no libseccomp needed, nor a package for it).

It checks the architecture first (a 32-bit or foreign syscall ABI is killed, so a table of
another ABI cannot be used to get around it; on x86_64 the x32 numbers get ``EPERM``), then
returns ``EPERM`` for the syscalls a scoring sandbox never needs: io_uring (its own path into the
kernel, past most of what is checked here), the kernel keyrings (keys persist per user, so one run
could leave one for the next: with these blocked each run has no keyring to share), ptrace and
reading other processes' memory, the mount family, bpf, perf, userfaultfd, kexec and modules.
``UNBOUNDED_MEMORY`` is blocked too where no cgroup bounds the sandbox (``offstep.sandbox.cgroup``):
memory held there (memfd, SysV shared memory, message queues, semaphore sets) counts in no rlimit.
"""

from __future__ import annotations

import platform
import struct

# name: (x86_64, aarch64); aarch64 uses the kernel's generic table, and new syscalls share numbers
SYSCALLS = {
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "kcmp": (312, 272),
    "pidfd_getfd": (438, 438),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "unshare": (272, 97),
    "setns": (308, 268),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "fanotify_init": (300, 262),
    "name_to_handle_at": (303, 264),
    "open_by_handle_at": (304, 265),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "syslog": (103, 116),
    "lookup_dcookie": (212, 18),
    "memfd_create": (319, 279),
    "shmget": (29, 194),
    "msgget": (68, 186),
    "semget": (64, 190),
}
X86_ONLY = {"iopl": 172, "ioperm": 173}
UNBOUNDED_MEMORY = ("memfd_create", "shmget", "msgget", "semget")
BLOCKED = tuple(n for n in SYSCALLS if n not in UNBOUNDED_MEMORY)

# <linux/audit.h>: the ELF machine with the 64-bit and little-endian flags
ARCHES = {"x86_64": (0xC000003E, 0), "aarch64": (0xC00000B7, 1)}
_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}
X32_BIT = 0x40000000

# <linux/filter.h>, <linux/seccomp.h>
_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
RET_ALLOW, RET_KILL_PROCESS, RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
EPERM = 1
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data


def machine() -> str | None:
    """This machine's architecture as the filter knows it, or None when it has no table for it."""
    name = platform.machine().lower()
    name = _ALIASES.get(name, name)
    return name if name in ARCHES else None


def numbers(arch: str, names) -> list[int]:
    """The syscall numbers of ``names`` on ``arch`` (x86-only names are skipped elsewhere)."""
    column = ARCHES[arch][1]
    found = [SYSCALLS[n][column] for n in names if n in SYSCALLS]
    if arch == "x86_64":
        found += [X86_ONLY[n] for n in names if n in X86_ONLY]
    return sorted(set(found))


def program(arch: str | None = None, bounded_memory: bool = True) -> bytes:
    """The filter's ``struct sock_filter`` array, as bwrap reads it from a file descriptor.
    ``bounded_memory=False`` blocks ``UNBOUNDED_MEMORY`` as well. Raises ValueError for an
    architecture without a table."""
    arch = arch or machine()
    if arch not in ARCHES:
        raise ValueError(f"no seccomp table for {platform.machine()!r} (known: {', '.join(ARCHES)})")
    names = [*BLOCKED, *X86_ONLY] + ([] if bounded_memory else list(UNBOUNDED_MEMORY))
    nrs = numbers(arch, names)
    n = len(nrs)
    ops = [
        (_LD_W_ABS, 0, 0, _ARCH),
        (_JEQ_K, 1, 0, ARCHES[arch][0]),
        (_RET_K, 0, 0, RET_KILL_PROCESS),
        (_LD_W_ABS, 0, 0, _NR),
    ]
    if arch == "x86_64":  # x32 ABI: the same arch value, numbers with bit 30 set
        ops.append((_JGE_K, n + 1, 0, X32_BIT))
    # each check jumps over the checks after it and the allow, onto the EPERM return
    ops += [(_JEQ_K, n - i, 0, nr) for i, nr in enumerate(nrs)]
    ops += [(_RET_K, 0, 0, RET_ALLOW), (_RET_K, 0, 0, RET_ERRNO | EPERM)]
    if n + 1 > 255:
        raise ValueError("too many syscalls for 8-bit jumps")
    return b"".join(struct.pack("=HBBI", *op) for op in ops)
