"""A pool of OpenEnv servers on 127.0.0.1, started by offstep and stopped by it (``env.kind=openenv``).

A rollout takes a free server for its episode and gives it back; when none is free a new one
starts, up to ``env.max_concurrent`` (0: as many as the rollouts at once). A server whose episode
ran out of time is killed, not given back (it may still be inside the hung step). ``close`` stops
every server, process and socket; a server also exits by itself when its parent process ends."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import weakref
from dataclasses import dataclass

START_TIMEOUT_S = 120.0


class ServerStartError(RuntimeError):
    """An environment server that did not come up (its own error in the message)."""


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:].strip()
    except OSError:
        return ""


def start_server(target: str, args: dict, path: list[str]) -> Server:
    """One server of ``target`` (module:attr), healthy; raises :class:`ServerStartError` with its stderr."""
    folder = tempfile.mkdtemp(prefix="offstep-openenv-")
    port_file, log = os.path.join(folder, "port"), os.path.join(folder, "log")
    spec = {
        "id": target,
        "args": args,
        "path": [os.path.abspath(p) for p in path],
        "port_file": port_file,
        "parent": os.getpid(),
    }
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "offstep.envs.openenv_server", json.dumps(spec)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(
                f"the OpenEnv server of {target} exited ({proc.returncode}) before serving:\n{_tail(log)}"
            )
        if os.path.exists(port_file):
            with open(port_file) as f:
                server = Server(proc, int(f.read()), log)
            try:
                with urllib.request.urlopen(server.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return server
            except OSError:
                pass
        time.sleep(0.1)
    _stop(proc)
    raise ServerStartError(
        f"the OpenEnv server of {target} did not answer /health in {START_TIMEOUT_S:.0f}s:\n{_tail(log)}"
    )


class ServerPool:
    def __init__(self, target: str, args: dict, path: list[str], cap: int = 0):
        self.target, self.args, self.path, self.cap = target, args, path, cap
        self._lock = threading.Lock()
        self._free: list[Server] = []
        self._all: list[Server] = []
        self._starting = 0
        self._closed = False
        procs = self._procs = []  # the finalizer must not hold the pool
        weakref.finalize(self, lambda: [_stop(p) for p in procs])

    def _add(self, server: Server) -> Server:
        with self._lock:
            self._all.append(server)
            self._procs.append(server.proc)
        return server

    def start(self) -> Server:
        """A new server of the pool, in use by the caller."""
        return self._add(start_server(self.target, self.args, self.path))

    async def acquire(self) -> Server:
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the OpenEnv server pool is closed")
                while self._free:
                    s = self._free.pop()
                    if s.proc.poll() is None:
                        return s
                grow = not self.cap or len(self._all) + self._starting < self.cap
                self._starting += grow
            if grow:
                try:
                    return await asyncio.to_thread(self.start)
                finally:
                    with self._lock:
                        self._starting -= 1
            await asyncio.sleep(0.05)

    def release(self, server: Server) -> None:
        with self._lock:
            if not self._closed and server.proc.poll() is None:
                self._free.append(server)

    def kill(self, server: Server) -> None:
        """Stop a server that may be stuck (its episode timed out); the next acquire starts another."""
        _stop(server.proc)
        with self._lock:
            if server in self._all:
                self._all.remove(server)

    def close(self) -> None:
        with self._lock:
            self._closed, servers, self._free = True, list(self._all), []
        for s in servers:
            _stop(s.proc)

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self._all]
