"""What a local run listens on: every listening TCP socket of the run's processes (the driver, Ray's
GCS, raylet, agents, monitor and dashboard process, the workers: the driver's whole process tree)
is on 127.0.0.1 or ::1, for both weight-sync paths; and Ray's token file is mode 0600.

A listener is found as the kernel lists it: the socket inodes a process holds
(``/proc/<pid>/fd/* -> socket:[inode]``) matched against the ``/proc/net/tcp`` and ``tcp6`` rows in
state 0A (LISTEN). Ray's gRPC servers bound to loopback are IPv6 sockets on ``::ffff:127.0.0.1``
(IPv4-mapped: they accept connections to 127.0.0.1 only), which counts as 127.0.0.1. The metrics
servers of Ray's autoscaler monitor and dashboard process (ports 44217, 44227) and the dashboard
agent's HTTP port (52365) are fixed ports: while another Ray on the machine holds them they are not
opened, so the test requires only the listeners every run has (GCS, raylet, agents, workers).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offstep.launch.loader import load_config
from offstep.pipeline import ray_init
from offstep.pipeline.ray_init import init_ray, keep_token_private, listen_summary

OFFSTEP = Path(sys.executable).with_name("offstep")
LOOPBACK = {ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")}


def decode(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as ``/proc/net/tcp{,6}`` writes it (32-bit words in host byte order) -> an address;
    an IPv4-mapped IPv6 address (``::ffff:127.0.0.1``) -> its IPv4 address."""
    raw = bytes.fromhex(hex_addr)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(raw)
    return addr.ipv4_mapped or addr if addr.version == 6 else addr


def listening_sockets() -> dict[str, tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """inode -> (address, port) of every TCP socket in state LISTEN on this machine."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    addr, port = fields[1].split(":")
                    out[fields[9]] = (decode(addr), int(port, 16))
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants, from each process's parent in ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    text = f.read()
            except OSError:  # it ended meanwhile
                continue
            ppid = int(text[text.rindex(")") + 2 :].split()[1])  # after "pid (comm) state"
            children.setdefault(ppid, []).append(int(name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def listeners_of(pids: list[int]) -> dict[tuple[int, str, int], str]:
    """(pid, address, port) -> the process's command line, for each listening TCP socket that ``pids`` hold."""
    table = listening_sockets()
    found = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:[") and link[8:-1] in table:
                addr, port = table[link[8:-1]]
                found[pid, str(addr), port] = cmd
    return found


def test_decode_proc_net_addresses():
    assert str(decode("0100007F")) == "127.0.0.1"
    assert str(decode("00000000")) == "0.0.0.0"
    assert str(decode("020200C0")) == "192.0.2.2"
    assert str(decode("00000000000000000000000001000000")) == "::1"
    assert str(decode("00000000000000000000000000000000")) == "::"
    assert str(decode("0000000000000000FFFF00000100007F")) == "127.0.0.1"  # ::ffff:127.0.0.1


def run_and_sample(args: list[str], env: dict, log: Path, timeout_s: float = 240):
    """Run ``offstep train ARGS``; while it runs, every listener of its process tree, sampled every
    0.3 s. Returns (exit status, the log, {(pid, address, port): the process's command lines})."""
    seen: dict[tuple[int, str, int], set[str]] = {}  # a Ray worker's command line changes: its titles
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(OFFSTEP), "train", *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() > deadline:
                pytest.fail(f"offstep train did not end within {timeout_s} s:\n{log.read_text()[-4000:]}")
            for key, cmd in listeners_of(process_tree(proc.pid)).items():
                seen.setdefault(key, set()).add(cmd)
            time.sleep(0.3)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, log.read_text(), seen


@pytest.mark.ray
def test_local_run_listens_on_loopback_only(tmp_path):
    """A local run on the collective weight sync: Ray's own listeners, the rollout workers' and the
    gloo group's store (the one listener the object-store path lacks; Ray's are the same on both
    paths), all on loopback."""
    home = tmp_path / "home"  # Ray's token file goes to $HOME/.ray/auth_token: this test's own
    home.mkdir()
    token = home / ".ray" / "auth_token"
    token.parent.mkdir()  # a token file readable to all (as Ray writes it): kept, made 0600
    token.write_text("ab" * 32)
    token.chmod(0o644)
    env = {**os.environ, "HOME": str(home), "RAY_ADDRESS": ""}  # its own local Ray, never another test's
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):  # Ray's defaults: token auth on
        env.pop(k, None)
    code, text, seen = run_and_sample(
        [
            "preset=tiny",
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.total_steps=2",
            "trainer.progress=plain",
            "trainer.val_before_train=false",
            "trainer.val_freq=0",
            "trainer.save_freq=0",
            "pipeline.weight_sync=collective",
        ],
        env,
        tmp_path / "log.txt",
    )
    assert code == 0 and "offstep: done" in text, text[-4000:]

    def who(cmd: str) -> str:
        return cmd.split()[0].rsplit("/", 1)[-1] if cmd.startswith("/") else cmd[:60]

    # the sampling saw the run's Ray cluster, not just the driver
    processes = {who(cmd) for cmds in seen.values() for cmd in cmds}
    for expected in ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"):
        assert expected in processes, f"no listener of {expected} seen: {sorted(processes)}"
    assert any(p.startswith("ray::RolloutWorker") for p in processes), sorted(processes)
    exposed = sorted(
        f"{f'[{addr}]' if ':' in addr else addr}:{port} (pid {pid}: {' | '.join(sorted(c[:160] for c in cmds))})"
        for (pid, addr, port), cmds in seen.items()
        if ipaddress.ip_address(addr) not in LOOPBACK
    )
    assert not exposed, "listeners not on loopback:\n" + "\n".join(exposed)

    assert token.exists()  # token authentication is on for a local cluster (Ray's default)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600, oct(token.stat().st_mode)
    assert token.read_text() == "ab" * 32  # Ray used the existing token


def test_token_file_is_created_private_or_made_private(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    token = tmp_path / ".ray" / "auth_token"
    keep_token_private(create=False)  # joining a cluster: no token is made up
    assert not token.exists()
    keep_token_private(create=True)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert len(token.read_text()) == 64 and int(token.read_text(), 16) >= 0  # 256 bits, hex, as Ray's own
    first = token.read_text()
    token.chmod(0o644)
    keep_token_private(create=True)  # an existing token is kept, only made private
    assert token.read_text() == first and stat.S_IMODE(token.stat().st_mode) == 0o600

    token.unlink()
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # no token auth: no token file
    keep_token_private(create=True)
    assert not token.exists()


def test_local_init_keeps_loopback_as_node_address(tmp_path, monkeypatch):
    """``init_ray`` for a local run asks Ray for node address 127.0.0.1 with Ray's cluster mode off
    (else ``ray.init`` maps 127.0.0.1 to the machine's address), and turns the mode back on after."""
    from ray._private import ray_constants

    monkeypatch.setenv("HOME", str(tmp_path))
    calls = []

    def fake_init(**kwargs):
        calls.append((kwargs, ray_constants.ENABLE_RAY_CLUSTER))

    monkeypatch.setattr(ray_init.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_init.ray, "init", fake_init)
    before = ray_constants.ENABLE_RAY_CLUSTER
    assert init_ray(load_config(["preset=tiny", f"trainer.output_dir={tmp_path}"]))
    [(kwargs, cluster_mode)] = calls
    assert kwargs["_node_ip_address"] == "127.0.0.1" and kwargs["dashboard_host"] == "127.0.0.1"
    assert cluster_mode is False and ray_constants.ENABLE_RAY_CLUSTER == before


@pytest.mark.parametrize(
    "address,loopback", [("127.0.0.1:6379", True), ("localhost:6379", True), ("10.1.2.3:6379", False)]
)
def test_joining_a_cluster_on_loopback_keeps_its_address(tmp_path, monkeypatch, address, loopback):
    """``resources.ray_address`` on 127.0.0.1 (a cluster started with ``--node-ip-address=127.0.0.1``,
    or by another run's tests): Ray's cluster mode is off for the ``ray.init``, else the driver maps
    127.0.0.1 to the machine's address, where the cluster's GCS does not listen, and waits forever."""
    from ray._private import ray_constants

    import offstep.pipeline.ray_address as ray_address

    monkeypatch.setenv("HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(ray_init.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_init.ray, "init", lambda **kw: calls.append((kw, ray_constants.ENABLE_RAY_CLUSTER)))
    monkeypatch.setattr(ray_address, "check_ray_address", lambda a: None)
    before = ray_constants.ENABLE_RAY_CLUSTER
    init_ray(load_config(["preset=tiny", f"trainer.output_dir={tmp_path}", f"resources.ray_address={address}"]))
    [(kwargs, cluster_mode)] = calls
    assert kwargs["address"] == address and cluster_mode is (before and not loopback)
    assert ray_constants.ENABLE_RAY_CLUSTER == before


def test_cluster_run_says_what_it_listens_on():
    assert listen_summary("10.0.0.5") == (
        "node address 10.0.0.5: this run's stores listen on 10.0.0.5, "
        "Ray's workers and processes on every interface (0.0.0.0)"
    )
    assert listen_summary("127.0.0.1").endswith("Ray's workers and processes on 127.0.0.1")
