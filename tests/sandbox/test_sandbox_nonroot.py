"""The sandbox called by a user that is not root (docs/sandbox.md).

A root caller runs bwrap as ``nobody``; a non-root caller runs it as itself, through unprivileged
user namespaces. The test suite runs as root on CI, so these tests start a child interpreter as
an unprivileged uid (``setpriv``, util-linux) that drives the sandbox itself, and check from outside: the
code runs, a listener the test opens on 127.0.0.1 is unreachable, a file the child's user can read
outside (it reads it first, unsandboxed) stays unread inside, the limits hold (without a cgroup,
which that user cannot make here: memfd is refused), and no process of the child's user is left.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CALLER = 65533  # a uid of its own (not nobody, which a root caller's sandboxes use): what it leaves is this test's
pytestmark = pytest.mark.heavy  # a child interpreter and several sandboxes: seconds

CHILD = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, sys.argv[1])
    from offstep.sandbox import Limits, Sandbox
    sb = Sandbox(Limits(timeout_s=12, cpu_s=2, processes=16, memory_mb=256))
    port, secret = sys.argv[2], sys.argv[3]
    out = {"uid": os.geteuid(), "outside": open(secret).read()}
    def run(name, code, stdin=""):
        r = sb.run(code, stdin)
        out[name] = {"ok": r.ok, "stdout": r.stdout[-200:], "what": r.describe()}
    run("print", "print(6 * 7)")
    run("net", "import socket\\ns = socket.socket(); s.settimeout(1)\\ns.connect(('127.0.0.1', int(input())))\\nprint('CONNECTED')", port)
    run("secret", "print(open(input()).read())", secret)
    run("loop", "while True: pass")
    run("fork_bomb", "import os\\nwhile True:\\n    os.fork()")
    run("memfd", "import os\\nos.memfd_create('m')")  # no cgroup for this user: memory no rlimit counts is refused
    print(json.dumps(out))
""")


def _uid_processes(uid: int) -> set[int]:
    return {int(p) for p in os.listdir("/proc") if p.isdigit() and os.stat(f"/proc/{p}").st_uid == uid}


def test_a_non_root_caller_gets_the_same_isolation():
    if os.geteuid() != 0:  # already not root: drive the sandbox directly below, as this user
        prefix: list[str] = []
        uid = os.geteuid()
    else:
        setpriv = shutil.which("setpriv")
        assert setpriv, "setpriv (util-linux) is needed to run the child as another user"
        prefix, uid = [setpriv, f"--reuid={CALLER}", f"--regid={CALLER}", "--clear-groups"], CALLER
    home = Path(tempfile.mkdtemp(prefix="offstep-nonroot-", dir="/var/tmp"))  # outside every bind of the sandbox
    secret = home / "secret"
    secret.write_text("TOP-SECRET")
    os.chown(home, uid, uid) if prefix else None
    os.chown(secret, uid, uid) if prefix else None
    secret.chmod(0o600)  # the child's user only
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    before = _uid_processes(uid)
    try:
        proc = subprocess.run(
            [*prefix, sys.executable, "-c", CHILD, str(ROOT), str(listener.getsockname()[1]), str(secret)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "HOME": str(home)},
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing reached the listener
    finally:
        listener.close()
        shutil.rmtree(home, ignore_errors=True)
    assert out["uid"] == uid and out["outside"] == "TOP-SECRET"  # the child itself can read it
    assert out["print"]["ok"] and out["print"]["stdout"].strip() == "42"
    assert not out["net"]["ok"] and "CONNECTED" not in out["net"]["stdout"]
    assert not out["secret"]["ok"] and "TOP-SECRET" not in out["secret"]["stdout"]
    assert (
        not out["loop"]["ok"] and "cpu limit" in out["loop"]["what"]
    )  # cpu_s=2 comes before timeout_s=12 (3 was too close on 2 loaded cores: the loop got under 2 CPU-s in 3 s)
    assert not out["fork_bomb"]["ok"], out["fork_bomb"]
    assert not out["memfd"]["ok"], out["memfd"]
    deadline = time.monotonic() + 5
    while (left := _uid_processes(uid) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of uid {uid} left: {sorted(left)}"
