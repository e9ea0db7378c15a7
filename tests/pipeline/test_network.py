"""What a run listens on: its own rendezvous stores bind the address they are given (127.0.0.1
for a local run), on a port held from the start. Every listener of a whole local run, Ray's
included: tests/pipeline/test_listeners.py."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import torch.distributed as dist

from offstep.dist import serve_store


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} writes them) listening on ``port``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, p = local.split(":")
                if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                    found.append(addr)
    return found


def test_store_listens_on_loopback_only_and_answers_there():
    store = serve_store("127.0.0.1", 2, timedelta(seconds=10))
    port = store.port
    assert _listeners(port) == ["0100007F"]  # 127.0.0.1 only: no 0.0.0.0 or [::] listener
    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"


def _listening_on(port: int) -> list[int]:
    """This process's descriptors of a socket listening on ``port``."""
    import socket

    found = []
    for n in map(int, os.listdir("/proc/self/fd")):
        try:
            s = socket.socket(fileno=os.dup(n))
        except OSError:  # not a socket, or the listing's own descriptor, gone already
            continue
        try:
            listens = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            found += [n] if listens and s.getsockname()[1:2] == (port,) else []
        except OSError:
            pass
        finally:
            s.close()
    return found


def test_the_store_alone_closes_its_socket():
    """The store owns its listening socket's descriptor and closes it when it ends, on a thread
    of its own. Nothing else may close that number again: once the process has reused it (a
    sandbox's code file, in the failure this pins), a second close would take that file away."""
    store = serve_store("127.0.0.1", None, timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"  # the store listens on the descriptor it was given
    (fd,) = _listening_on(store.port)
    del client, store
    deadline = time.monotonic() + 10
    while _is_open(fd):  # the store's own thread closes it
        assert time.monotonic() < deadline, f"the store's socket {fd} was never closed"
        time.sleep(0.05)
    held = []
    while not held or held[-1] < fd:  # take the lowest free numbers until the freed one is ours again
        held.append(os.open(os.devnull, os.O_RDONLY))
    assert held[-1] == fd
    gc.collect()
    time.sleep(0.5)
    try:
        assert _is_open(fd), "something closed the store's old descriptor a second time"
    finally:
        for n in held:
            os.close(n)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False
