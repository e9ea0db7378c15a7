"""What a run listens on: its own rendezvous stores bind the address they are given (127.0.0.1
for a local run), on a port held from the start. Every listener of a whole local run, Ray's
included: tests/test_listeners.py."""

from __future__ import annotations

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
    store, sock = serve_store("127.0.0.1", 2, timedelta(seconds=10))
    host, port = sock.getsockname()
    assert host == "127.0.0.1"
    assert _listeners(port) == ["0100007F"]  # 127.0.0.1 only: no 0.0.0.0 or [::] listener
    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
