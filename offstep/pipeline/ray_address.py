"""The check of ``resources.ray_address`` before a run joins a cluster: made before anything is
prepared (``offstep train``'s checks) and again by the run itself as it starts Ray. Imports only
the standard library, so that the checks stay fast."""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from offstep.errors import ConfigError


def check_ray_address(address: str | None, timeout_s: float = 3.0) -> None:
    """Fail fast when ``resources.ray_address`` names a host and port where nothing listens (Ray
    itself retries for about 25 s and then raises a ConnectionError with no fix): a TCP connect
    of at most ``timeout_s`` seconds. "auto", "local" and addresses without a port are left to Ray."""
    if not address or address in ("auto", "local"):
        return
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:  # a port that is not a number
        host, port = None, None
    if not host or port is None:
        return
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        why = "timed out" if isinstance(err, TimeoutError) else (err.strerror or type(err).__name__)
        raise ConfigError(
            f"resources.ray_address={address!r}: no Ray cluster answers at {host}:{port} ({why}). Fix: start the "
            f"cluster there first (`ray start --head --port={port}` on that machine), or leave "
            f"resources.ray_address empty (null) for a local Ray started by this run"
        ) from None
