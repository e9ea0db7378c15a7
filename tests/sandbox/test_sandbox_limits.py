"""Limits per sandbox, not per process (docs/sandbox.md#limits-per-sandbox): a cgroup bounds the
memory of the whole tree (children, SysV shared memory, memfd, kernel memory of a directory
burst), seccomp blocks io_uring, the keyrings and the syscalls a scoring sandbox never needs, and
no execution leaves a zombie. Each attack prints what it holds as it goes (flushed), so that a
sandbox killed for its limit still says how far it got."""

from __future__ import annotations

import errno
import os
import platform
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from offstep.sandbox import Limits, Sandbox, seccomp
from offstep.sandbox.cgroup import ENV, PREFIX, parents

ROOT = Path(__file__).resolve().parents[2]
TIGHT = Limits(
    timeout_s=8, cpu_s=8, memory_mb=256, processes=32, file_mb=16, open_files=64, tmp_mb=8, output_bytes=64 * 1024
)
BOUND_MB = TIGHT.memory_mb + TIGHT.tmp_mb  # the cgroup's limit
GROUPS = parents() is not None  # a writable cgroup here (root); else the per-process fallback
needs_groups = pytest.mark.skipif(not GROUPS, reason="no writable cgroup here (the fallback is tested below)")
LIBC = "import ctypes, os, sys\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def _held(stdout: str, word: str = "held") -> int:
    """The last count the code printed before it stopped."""
    found = re.findall(rf"^{word} (\d+)$", stdout, re.M)
    return int(found[-1]) if found else 0


def _check_peak(result) -> None:
    if GROUPS:
        assert result.memory_peak_mb is not None and result.memory_peak_mb <= BOUND_MB + 1, result


# ------------------------------------------------------------------------------- memory of the whole tree


@needs_groups
@pytest.mark.heavy
def test_many_children_share_one_memory_limit():
    code = textwrap.dedent("""
        import os, sys, time
        for _ in range(8):
            if os.fork() == 0:
                block = b'x' * (100 << 20)  # every page written
                print('ok', flush=True)
                time.sleep(2)
                os._exit(0)
        for _ in range(8):
            os.wait()
    """)
    r = Sandbox(TIGHT).run(code)
    oks = r.stdout.split().count("ok")
    # Without the cgroup all 8 hold 100 MB each at once: 800 MB. With it, the kernel kills children to stay
    # under the bound, and may pick one that has already printed, so the count of "ok" is not the
    # memory held at one time; the cgroup's own peak is.
    assert oks < 8, (oks, r)
    _check_peak(r)


@needs_groups
@pytest.mark.heavy
def test_sysv_shared_memory_counts_in_the_limit():
    code = LIBC + textwrap.dedent("""
        libc.shmat.restype = ctypes.c_void_p
        size, held = 32 << 20, 0
        while held < 1024:  # 1 GB at most, should the limit not hold
            sid = libc.shmget(0, size, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
            if sid < 0:
                print('shmget', ctypes.get_errno()); break
            addr = libc.shmat(sid, None, 0)
            ctypes.memset(addr, 1, size)  # the pages stay with the segment after detaching
            libc.shmdt(ctypes.c_void_p(addr))
            held += 32
            print('held', held, flush=True)
    """)
    r = Sandbox(TIGHT).run(code)
    assert _held(r.stdout) <= BOUND_MB and not r.ok, r
    _check_peak(r)


@needs_groups
@pytest.mark.heavy
def test_memfd_files_count_in_the_limit():
    code = textwrap.dedent("""
        import os
        fds, held, chunk = [], 0, b'x' * (16 << 20)
        while held < 1024:  # 1 GB at most; each file stops at file_mb (16 MB), so one file per chunk
            fd = os.memfd_create('m')
            os.write(fd, chunk)
            fds.append(fd)
            held += 16
            print('held', held, flush=True)
    """)
    r = Sandbox(TIGHT).run(code)
    assert _held(r.stdout) <= BOUND_MB and not r.ok, r  # the tmpfs's 8 MB do not bound memfd
    _check_peak(r)


@needs_groups
@pytest.mark.heavy
def test_a_burst_of_empty_directories_is_bounded_by_the_kernel_memory_it_takes():
    limits = Limits(**{**TIGHT.__dict__, "memory_mb": 64})
    code = textwrap.dedent("""
        import os
        n = 0
        try:
            while n < 200000:
                os.mkdir(f'/tmp/d{n}')
                n += 1
                if n % 5000 == 0:
                    print('held', n, flush=True)
        except OSError as e:
            print('stopped', e.errno, n, flush=True)
    """)
    r = Sandbox(limits).run(code)
    # ~1.25 KB of inode and dentry each: 200k are ~250 MB, past 72 MB (the tmpfs counts no inodes)
    assert _held(r.stdout) < 200000 and "stopped 28" not in r.stdout, r
    assert r.memory_peak_mb is not None and r.memory_peak_mb <= limits.memory_mb + limits.tmp_mb + 1, r


@needs_groups
@pytest.mark.heavy
def test_the_cgroup_is_removed_after_a_run_and_after_a_timeout():
    sb = Sandbox(Limits(**{**TIGHT.__dict__, "timeout_s": 1.5}))
    sb.run("print(1)")
    r = sb.run("import os, time\nos.fork()\ntime.sleep(30)")
    assert r.timed_out
    left = [
        os.path.join(d, e) for d in parents()[1] if d for e in os.listdir(d) if e.startswith(f"{PREFIX}{os.getpid()}-")
    ]
    assert not left, left


# ------------------------------------------------------------------------------- seccomp


def test_io_uring_setup_fails_with_eperm():
    r = Sandbox(TIGHT).run(
        LIBC + "params = ctypes.create_string_buffer(120)\nprint(libc.syscall(425, 8, params), ctypes.get_errno())"
    )
    assert r.stdout.split() == ["-1", str(errno.EPERM)], r  # without the filter: a file descriptor


@pytest.mark.heavy
def test_the_keyrings_are_out_of_reach_so_no_run_sees_another_runs_key():
    add = LIBC + (
        "print(libc.syscall(%d, b'user', b'offstep-test', b'secret', 6, -4), ctypes.get_errno())"
        % seccomp.numbers(seccomp.machine(), ["add_key"])[0]
    )
    search = LIBC + (
        "print(libc.syscall(%d, 10, -4, b'user', b'offstep-test', 0), ctypes.get_errno())"
        % seccomp.numbers(seccomp.machine(), ["keyctl"])[0]
    )  # KEYCTL_SEARCH the user keyring
    sb = Sandbox(TIGHT)
    assert sb.run(add).stdout.split() == ["-1", str(errno.EPERM)]
    assert sb.run(search).stdout.split() == ["-1", str(errno.EPERM)]


@pytest.mark.heavy
def test_ptrace_mount_bpf_perf_userfaultfd_unshare_fail_and_the_rest_works():
    names = ["ptrace", "mount", "bpf", "perf_event_open", "userfaultfd", "unshare", "open_by_handle_at"]
    nrs = [seccomp.numbers(seccomp.machine(), [n])[0] for n in names]
    code = (
        LIBC + f"for nr in {nrs}:\n    print(libc.syscall(nr, 0, 0, 0, 0, 0), ctypes.get_errno())\n"
        "print('pid', os.getpid(), open('/tmp/main.py').read(3))"
    )
    r = Sandbox(TIGHT).run(code)
    lines = r.stdout.splitlines()
    assert lines[:-1] == [f"-1 {errno.EPERM}"] * len(names), r
    assert lines[-1] == "pid 2 imp", r  # the init is PID 1; files and getpid still work


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x32 ABI is x86_64's")
def test_x32_syscall_numbers_fail_too():
    r = Sandbox(TIGHT).run(LIBC + "print(libc.syscall(0x40000000 | 39), ctypes.get_errno())")  # x32 getpid
    assert r.stdout.split() == ["-1", str(errno.EPERM)], r


def _unistd(path: str) -> dict[str, int]:
    return {m[0]: int(m[1]) for m in re.findall(r"#define __NR_(\w+)\s+(\d+)\b", Path(path).read_text())}


@pytest.mark.parametrize(
    "arch,header",
    [("x86_64", "/usr/include/x86_64-linux-gnu/asm/unistd_64.h"), ("aarch64", "/usr/include/asm-generic/unistd.h")],
)
def test_the_syscall_tables_match_the_kernel_headers(arch, header):
    if not os.path.exists(header):
        pytest.skip(f"{header} is not installed")
    known = _unistd(header)
    column = seccomp.ARCHES[arch][1]
    for name, nrs in seccomp.SYSCALLS.items():
        assert known[name] == nrs[column], (arch, name)
    if arch == "x86_64":
        assert all(known[n] == nr for n, nr in seccomp.X86_ONLY.items())


def _filtered(arch: str, code: str, bounded: bool = True) -> subprocess.CompletedProcess:
    """``code`` run in a child interpreter after it loaded the filter for ``arch``."""
    loader = (
        LIBC
        + textwrap.dedent(f"""
        sys.path.insert(0, {str(ROOT)!r})
        from offstep.sandbox.seccomp import program
        prog = program({arch!r}, bounded_memory={bounded})
        buf = ctypes.create_string_buffer(prog, len(prog))
        class Fprog(ctypes.Structure):
            _fields_ = [('len', ctypes.c_ushort), ('filter', ctypes.c_void_p)]
        fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
        assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
        assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER
    """)
        + code
    )
    return subprocess.run([sys.executable, "-I", "-c", loader], capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(seccomp.machine() is None, reason="no seccomp table for this machine")
def test_the_filter_blocks_its_list_and_kills_another_architecture():
    arch = seccomp.machine()
    nrs = [seccomp.numbers(arch, [name])[0] for name in ("keyctl", "io_uring_setup", "memfd_create")]
    done = _filtered(arch, f"print([libc.syscall(nr, 0, 0, 0, 0) == -1 and ctypes.get_errno() for nr in {nrs}])")
    # keyctl and io_uring_setup: EPERM; memfd_create is let through (EFAULT for its NULL name): a cgroup bounds it
    assert done.stdout.strip() == f"[{errno.EPERM}, {errno.EPERM}, {errno.EFAULT}]", done
    done = _filtered(arch, f"print(libc.syscall({nrs[-1]}, b'm', 0), ctypes.get_errno())", bounded=False)
    assert done.stdout.split() == ["-1", str(errno.EPERM)], done
    other = next(a for a in seccomp.ARCHES if a != arch)
    done = _filtered(other, "print('survived')")
    assert done.returncode == -31 and "survived" not in done.stdout  # SIGSYS: the arch check kills


# ------------------------------------------------------------------------------- without a cgroup


@pytest.mark.heavy
def test_without_a_cgroup_memory_outside_the_rlimits_is_refused_and_the_tree_shares_one_total(monkeypatch):
    monkeypatch.setenv(ENV, "off")
    code = LIBC + textwrap.dedent("""
        import resource
        print(resource.getrlimit(resource.RLIMIT_NPROC)[0], resource.getrlimit(resource.RLIMIT_AS)[0] >> 20)
        try:
            print('allowed', os.memfd_create('m'))
        except OSError as e:
            print('refused', e.errno)
        sid = libc.shmget(0, 1 << 20, 0o1600)
        print('allowed' if sid >= 0 else 'refused', sid if sid >= 0 else ctypes.get_errno())
    """)
    r = Sandbox(TIGHT).run(code)
    lines = r.stdout.splitlines()
    assert lines[0] == "4 64", r  # 4 processes (the init included) x 64 MB = memory_mb
    assert lines[1:] == [f"refused {errno.EPERM}"] * 2, r
    assert r.memory_peak_mb is None


# ------------------------------------------------------------------------------- zombies

REAPING_NOTHING = textwrap.dedent("""
    import ctypes, os, sys
    sys.path.insert(0, sys.argv[1])
    assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: orphans come here, as to a PID 1
    from offstep.sandbox import Limits, Sandbox
    sb = Sandbox(Limits(timeout_s=1, processes=8, memory_mb=128))
    results = [sb.run('pass' if i % 20 else 'import time; time.sleep(9)') for i in range(int(sys.argv[2]))]
    assert all(r.ok or r.timed_out for r in results), results[:3]
    zombies = []
    for p in os.listdir('/proc'):
        try:
            stat = open(f'/proc/{p}/stat').read()
        except (OSError, ValueError):
            continue
        state, ppid = stat[stat.rindex(')') + 2:].split()[:2]
        if state == 'Z' and int(ppid) == os.getpid():
            zombies.append(p)
    print('zombies', len(zombies))
""")


@pytest.mark.heavy
def test_a_hundred_runs_under_a_parent_that_reaps_nothing_leave_no_zombie():
    """Every twentieth run is killed at its time limit: the kill path waits too."""
    done = subprocess.run(
        [sys.executable, "-c", REAPING_NOTHING, str(ROOT), "100"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, ENV: "off"} if not GROUPS else None,
    )
    assert done.returncode == 0 and done.stdout.split() == ["zombies", "0"], (done.stdout, done.stderr[-2000:])
