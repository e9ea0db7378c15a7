"""The sandbox's security battery: one test per attack (docs/sandbox.md#the-security-battery).

After each: the caller goes on (the call returns a result), nothing outside changed (the
secrets and sentinels the test placed are intact, nothing appeared where the code tried to
write), no process is left (no new process runs as the sandbox's user or in another PID
namespace, zombies included), and the result says what happened. Tight limits keep each test
to a few seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from offstep.sandbox import Limits, Sandbox
from offstep.sandbox.bwrap import NOBODY

LIMITS = Limits(
    timeout_s=4, cpu_s=3, memory_mb=256, processes=16, file_mb=1, open_files=32, tmp_mb=8, output_bytes=64 * 1024
)
OUR_PID_NS = os.readlink("/proc/self/ns/pid")
pytestmark = pytest.mark.heavy  # a sandbox per test, some of them waiting out a limit: seconds each


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (real uid, PID namespace) of every process (zombies included) this user can see."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            uid = int(
                next(
                    line for line in Path(f"/proc/{entry}/status").read_text().splitlines() if line.startswith("Uid:")
                ).split()[1]
            )
            ns = os.readlink(f"/proc/{entry}/ns/pid")
        except (OSError, StopIteration):  # gone meanwhile, or a zombie without its ns link
            try:
                uid, ns = os.stat(f"/proc/{entry}").st_uid, "?"
            except OSError:
                continue
        found[int(entry)] = (uid, ns)
    return found


def _left_over(before: dict[int, tuple[int, str]]) -> list[int]:
    """New processes that belong to a sandbox: its user's, or in a PID namespace not ours."""
    sandbox_uid = NOBODY if os.geteuid() == 0 else -1
    return [
        pid
        for pid, (uid, ns) in _processes().items()
        if pid not in before and pid != os.getpid() and (uid == sandbox_uid or ns not in (OUR_PID_NS, "?"))
    ]


def attack(code: str, stdin: str = "", limits: Limits = LIMITS):
    """Run ``code`` in a sandbox; check that no process of it is left; return the result."""
    before = _processes()
    t0 = time.monotonic()
    result = Sandbox(limits).run(code, stdin)
    assert time.monotonic() - t0 < limits.timeout_s + 5, "the caller waited past the time limit"
    deadline = time.monotonic() + 3
    while (left := _left_over(before)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left after the sandbox: {left}"
    return result


# ------------------------------------------------------------------------------- network


def test_connecting_to_a_listener_outside_fails_and_it_sees_nothing():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        r = attack(
            f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            f"    print('CONNECTED')\nexcept OSError as e:\n    print('blocked', e.errno)"
        )
        with pytest.raises(BlockingIOError):
            server.accept()  # no connection ever arrived
    finally:
        server.close()
    assert r.stdout.startswith("blocked") and "CONNECTED" not in r.stdout


def test_a_dns_lookup_fails():
    r = attack(
        "import socket\ntry:\n    print('RESOLVED', socket.getaddrinfo('example.com', 80))\n"
        "except OSError as e:\n    print('blocked', type(e).__name__)"
    )
    assert r.stdout.startswith("blocked") and r.exit_code == 0


def test_only_a_loopback_of_its_own_exists():
    r = attack("import socket\nprint(sorted(n for _, n in socket.if_nameindex()))")
    assert r.stdout.strip() == "['lo']"


# ------------------------------------------------------------------------------- files


def test_the_home_folders_and_root_are_not_there():
    r = attack(
        "import os\nfor p in ('/root', '/home', '/work', os.path.expanduser('~') + '/..'):\n"
        "    try:\n        print(p, os.listdir(p))\n    except OSError as e:\n        print(p, 'ERR', e.errno)"
    )
    lines = r.stdout.splitlines()
    assert [line.split()[1] for line in lines[:3]] == ["ERR"] * 3, r.stdout
    assert "root" not in lines[3] and "work" not in lines[3]  # ~ is the tmp: its parent is the sandbox's /


def test_proc_1_environ_holds_none_of_the_callers_environment(monkeypatch):
    monkeypatch.setenv("OFFSTEP_TEST_SECRET", "s3cr3t-token")
    r = attack(
        "import os\nfor p in ('/proc/1/environ', '/proc/self/environ'):\n"
        "    try:\n        print(open(p, 'rb').read())\n    except OSError as e:\n        print('ERR', e.errno)"
    )
    assert "s3cr3t" not in r.stdout and "OFFSTEP_TEST_SECRET" not in r.stdout and "/root" not in r.stdout


def test_the_run_folder_cannot_be_read_by_its_absolute_path(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "secret.txt").write_text("weights-and-secrets")
    here = Path(__file__).resolve()
    r = attack(
        f"for p in ({str(run / 'checkpoints' / 'secret.txt')!r}, {str(here)!r}):\n"
        "    try:\n        print(open(p).read()[:40])\n    except OSError as e:\n        print('ERR', e.errno)"
    )
    assert r.stdout.split() == ["ERR", "2", "ERR", "2"], r.stdout
    assert (run / "checkpoints" / "secret.txt").read_text() == "weights-and-secrets"


def test_writing_outside_the_tmp_fails_and_leaves_nothing(tmp_path):
    targets = [
        "/usr/offstep_pwned",
        "/etc/offstep_pwned",
        "/offstep_pwned",
        "/bin/offstep_pwned",
        "/dev/offstep_pwned",
        "/proc/offstep_pwned",
        str(tmp_path / "pwned"),
    ]
    r = attack(
        f"for p in {targets!r}:\n    try:\n        open(p, 'w').write('x')\n        print('WROTE', p)\n"
        "    except OSError as e:\n        print('ERR', e.errno)\n"
        "open('/tmp/inside', 'w').write('fine')\nprint(open('/tmp/inside').read())"
    )
    assert "WROTE" not in r.stdout and r.stdout.splitlines()[-1] == "fine", r.stdout
    for p in targets:
        assert not os.path.exists(p)


def test_symlinks_and_dotdot_lead_nowhere_outside(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    code = f"""import os
os.symlink({str(secret)!r}, '/tmp/link')
os.symlink('/', '/tmp/up')
tries = ['/tmp/link', '/tmp/up/root', '/tmp/../../../../root', '/tmp/../../{str(tmp_path)[1:]}/secret.txt',
         '/proc/self/root/../../root', '/proc/1/root/work', '/proc/1/cwd/secret.txt', '/proc/self/cwd/../../work']
for p in tries:
    try:
        print('READ', p, open(p).read() if os.path.isfile(p) else os.listdir(p))
    except OSError as e:
        print('ERR', e.errno)
"""
    r = attack(code)
    assert "outside" not in r.stdout and "READ" not in r.stdout, r.stdout
    assert len(r.stdout.splitlines()) == 8 and secret.read_text() == "outside"


# ------------------------------------------------------------------------------- processes


def test_a_fork_bomb_is_bounded_and_ends():
    """Whichever bound the bomb meets first ends it: the pid count, the wall clock, the CPU, or the
    sandbox's memory cgroup, which counts every child's pages (under load the copies fill it
    before the pid limit is reached)."""
    r = attack("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert r.limit in ("timeout", "processes", "cpu", "memory") and not r.ok, r
    assert r.memory_peak_mb is None or r.memory_peak_mb <= LIMITS.memory_mb + LIMITS.tmp_mb, r  # the cgroup's bound


def test_a_memory_bomb_fails_with_memory_error():
    r = attack("chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))")
    assert r.limit == "memory" and "MemoryError" in r.stderr


def test_an_infinite_loop_is_stopped_by_the_cpu_or_wall_clock():
    r = attack("while True:\n    pass", limits=Limits(**{**LIMITS.__dict__, "timeout_s": 2, "cpu_s": 10}))
    assert r.timed_out and r.limit == "timeout" and r.exit_code is None
    r = attack("while True:\n    pass", limits=Limits(**{**LIMITS.__dict__, "timeout_s": 6, "cpu_s": 1}))
    assert r.limit == "cpu" and not r.timed_out  # SIGXCPU


def test_setsid_and_a_double_fork_do_not_outlive_the_execution():
    code = """import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        signal_ignored = __import__('signal').signal(1, __import__('signal').SIG_IGN)
        time.sleep(60)
    os._exit(0)
print('parent done')
"""
    r = attack(code)  # the main process returns at once; the daemon must go with it
    assert r.stdout == "parent done\n" and r.exit_code == 0 and r.seconds < 3


def test_a_daemon_holding_the_output_open_is_killed_at_the_deadline():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)"
    r = attack(code, limits=Limits(**{**LIMITS.__dict__, "timeout_s": 2}))
    assert r.timed_out


def test_signalling_the_parent_and_everyone_reaches_nothing_outside():
    bystander = subprocess.Popen(["sleep", "30"], user=NOBODY if os.geteuid() == 0 else None)
    try:
        code = (
            "import os, signal\nfor sig in (signal.SIGKILL, signal.SIGTERM):\n"
            "    try:\n        os.kill(os.getppid(), sig)\n    except OSError as e:\n        print('ERR', e.errno)\n"
            f"try:\n    os.kill({bystander.pid}, signal.SIGKILL)\nexcept OSError as e:\n    print('ERR', e.errno)\n"
            "os.system('kill -9 -1')\nprint('still here?')"
        )
        r = attack(code)
        assert bystander.poll() is None, "a process outside the sandbox was killed"
        assert r.exit_code == -signal.SIGKILL and r.limit is None  # kill -1 took the code itself down
    finally:
        bystander.kill()
        bystander.wait()


def test_zombies_left_behind_are_reaped_with_the_sandbox():
    code = (
        "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        os._exit(0)\n"
        "time.sleep(0.3)\nprint('zombies', sum(1 for p in os.listdir('/proc') if p.isdigit()))"
    )
    r = attack(code)
    assert r.stdout.startswith("zombies") and r.exit_code == 0


# ------------------------------------------------------------------------------- output


def test_a_stdout_flood_is_cut_while_reading():
    r = attack("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert r.limit == "output" and r.truncated and len(r.stdout) + len(r.stderr) <= LIMITS.output_bytes


def test_a_huge_file_is_refused_and_the_tmp_is_bounded():
    code = (
        "import os\ntry:\n    open('/tmp/big', 'wb').write(b'x' * (4 << 20))\nexcept OSError as e:\n"
        "    print('big', e.errno)\nn = 0\ntry:\n    while True:\n"
        "        open(f'/tmp/f{n}', 'wb').write(b'x' * (512 << 10)); n += 1\nexcept OSError as e:\n"
        "    print('full', e.errno, n)"
    )
    r = attack(code)
    lines = r.stdout.split("\n")
    assert lines[0] == "big 27"  # EFBIG: RLIMIT_FSIZE
    full = lines[1].split()
    assert full[:2] == ["full", "28"] and int(full[2]) <= 16  # ENOSPC at tmp_mb


def test_binary_garbage_and_invalid_utf8_come_back_as_text():
    r = attack(
        "import os, sys\nsys.stdout.buffer.write(os.urandom(2048) + b'\\xff\\xfe\\x80 end')\n"
        "sys.stderr.buffer.write(b'\\xc3\\x28 err')"
    )
    assert isinstance(r.stdout, str) and r.stdout.endswith(" end") and "\ufffd" in r.stdout
    assert r.stderr.endswith("( err") and r.exit_code == 0
