"""The network side of torch.distributed that the trainer groups (``offstep.train.distributed``),
the weight-sync group (``offstep.sync.collective``) and the driver (``offstep.pipeline.pools``)
share: a ``TCPStore`` served on one address only, and gloo bound to the interface that reaches a
group's store."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

STORE_TIMEOUT = timedelta(minutes=30)  # torch's default for a process group


def serve_store(host: str, world_size: int | None, timeout: timedelta = STORE_TIMEOUT) -> dist.TCPStore:
    """A ``TCPStore`` server that listens on ``host`` only (torch's own listens on every
    interface), on a socket bound before the store starts: no port is picked, closed and bound
    again later, which another process could take in between. Its port: ``store.port``.

    The store owns the socket's file descriptor and closes it when it ends, on a thread of its
    own. So the Python socket lets go of it (``detach``): closed by both, the number would be
    closed twice, the second time after this process may have reused it for another file."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            world_size,
            True,
            timeout,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()
    return store


def route_interface(peer: str) -> str | None:
    """The name of this machine's network interface that packets to ``peer`` leave from (the
    source address the kernel picks for that route), or None when it cannot tell."""
    try:
        import psutil  # Ray's dependency; not offstep's own

        family = socket.AF_INET6 if ":" in peer else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))  # UDP: picks the route, sends nothing
            local = s.getsockname()[0]
        return next(
            (name for name, addrs in psutil.net_if_addrs().items() if any(a.address == local for a in addrs)), None
        )
    except (ImportError, OSError):
        return None


def bind_gloo_to_route(peer: str) -> None:
    """Make gloo (``GLOO_SOCKET_IFNAME``, read by every gloo group this process makes) use the
    interface that reaches ``peer``, a group's store, unless the user set one. Left to itself,
    gloo binds the address this machine's host name resolves to, which is often loopback
    (``127.0.1.1`` in Debian's /etc/hosts): ranks on other machines could not reach it. For a
    local run (``peer`` 127.0.0.1) this keeps gloo's listeners on loopback."""
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        iface = route_interface(peer)
        if iface:
            os.environ["GLOO_SOCKET_IFNAME"] = iface
