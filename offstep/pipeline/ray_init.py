"""Starting or joining Ray for a run: a local Ray on loopback only, its token kept private, or the
cluster ``resources.ray_address`` names (checked first); and what a run listens on."""

from __future__ import annotations

import logging
import os
import secrets
from contextlib import contextmanager
from pathlib import Path

import ray

from offstep.config.schema import Config

log = logging.getLogger(__name__)
LOOPBACK = "127.0.0.1"


def ray_token_path() -> Path:
    """Ray's default token file: what a local cluster's token authentication reads when neither
    ``RAY_AUTH_TOKEN`` nor ``RAY_AUTH_TOKEN_PATH`` is set (``ray get-auth-token --generate`` writes it too)."""
    return Path.home() / ".ray" / "auth_token"


def keep_token_private(create: bool) -> None:
    """Ray writes ``~/.ray/auth_token`` with a plain ``open(path, "w")``: mode 0644 under the usual
    umask, so every user of the machine could read the token. Ray keeps a token file that already
    exists, so when ``create`` (a local cluster that will use it) one is created first, mode 0600,
    with a token like Ray's own (256 random bits, hex); an existing one is made 0600."""
    path = ray_token_path()
    if (
        create
        and not path.exists()
        and os.environ.get("RAY_AUTH_MODE", "").lower() != "disabled"
        and not os.environ.get("RAY_AUTH_TOKEN")
        and not os.environ.get("RAY_AUTH_TOKEN_PATH")
    ):
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:  # another process wrote it first: tightened below
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
    try:
        if path.stat().st_mode & 0o077:
            path.chmod(0o600)
    except FileNotFoundError:
        pass


def listen_summary(node_ip: str) -> str:
    """What a run on a cluster listens on, for its start-up log: the run's rendezvous stores bind the
    node's address; Ray's core workers (this driver's too) and the node's Ray processes bind every
    interface unless the node's address is a loopback one."""
    ray_side = "127.0.0.1" if node_ip in (LOOPBACK, "::1", "localhost") else "every interface (0.0.0.0)"
    return f"node address {node_ip}: this run's stores listen on {node_ip}, Ray's workers and processes on {ray_side}"


def init_ray(cfg: Config) -> bool:
    """Connect to ``resources.ray_address`` or start a local Ray; True when this run started it.

    A local cluster listens on 127.0.0.1 only. Every Ray listener follows the node's IP address:
    the GCS, the raylet's node-manager and object-manager ports and each core worker's gRPC server
    (the driver's too) bind loopback instead of every interface when it is a loopback address, and
    so do the dashboard agent (gRPC and HTTP), the runtime-env agent and the metrics servers of
    the autoscaler monitor and of the dashboard process (started even with include_dashboard=False).
    ``ray.init(_node_ip_address="127.0.0.1")`` alone is not enough: ``ray.init`` maps a loopback
    address to the machine's address (``services.resolve_ip_for_localhost``) unless
    ``ray_constants.ENABLE_RAY_CLUSTER`` is off, the local-only mode Ray uses on macOS and Windows
    (env ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when ``ray`` is imported, so here it is set
    on the imported module, for the ``ray.init`` call only)."""
    if ray.is_initialized():
        return False
    kwargs = dict(include_dashboard=False, log_to_driver=True, logging_level="WARNING")
    if cfg.resources.ray_address:
        from offstep.pipeline.ray_address import check_ray_address

        check_ray_address(cfg.resources.ray_address)  # Ray would retry for 25 s, then raise with no fix
        keep_token_private(create=False)
        host = cfg.resources.ray_address.rsplit(":", 1)[0].strip("[]")
        with keep_loopback(host in (LOOPBACK, "localhost", "::1")):  # a cluster on 127.0.0.1: join it there
            ray.init(address=cfg.resources.ray_address, **kwargs)
    else:
        # A local cluster: no metrics exporter (an unauthenticated listener on every interface),
        # and Ray's token authentication (on by default for local clusters since Ray 2.59) stays on.
        os.environ.setdefault("RAY_enable_metrics_collection", "0")
        if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
            log.warning(
                "RAY_AUTH_MODE=disabled: anyone who can reach this machine's Ray ports can run code in "
                "this run's cluster; unset it to keep Ray's token authentication on"
            )
        keep_token_private(create=True)
        with keep_loopback(True):
            ray.init(num_cpus=os.cpu_count(), _node_ip_address=LOOPBACK, dashboard_host=LOOPBACK, **kwargs)
    keep_token_private(create=False)  # in case Ray wrote it after all
    return True


@contextmanager
def keep_loopback(on: bool):
    """``ray.init`` inside keeps a loopback node address (see ``init_ray``) when ``on``: for a local
    cluster, and for joining a cluster whose address is loopback (its GCS listens there only;
    mapped to the machine's address, the connection never comes)."""
    from ray._private import ray_constants

    cluster_mode = ray_constants.ENABLE_RAY_CLUSTER
    if on:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
