"""One OpenEnv server on 127.0.0.1, a child process of offstep (``offstep.envs.openenv_pool``).

Run as ``python -m offstep.envs.openenv_server SPEC_JSON``: ``id`` is ``module:attr``, either an
app an OpenEnv package ships (its ``server.app:app``) or an ``Environment`` subclass served with
openenv-core's ``create_app`` (its Action and Observation types read from ``step``'s annotations),
built with ``args``. The port is the kernel's pick, written to ``port_file`` once listening. The
server exits when its parent does (a killed Ray worker cannot stop its children itself)."""

from __future__ import annotations

import functools
import importlib
import json
import os
import socket
import sys
import threading
import time
import typing

from offstep.errors import ConfigError


def build_app(target: str, args: dict):
    from openenv.core.env_server.http_server import create_app
    from openenv.core.env_server.interfaces import Environment

    module, _, attr = target.partition(":")
    if not attr:
        raise ConfigError(f"env.id={target!r} is not module:attr (an app, or an openenv Environment class)")
    obj = getattr(importlib.import_module(module), attr)
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        if args:
            raise ConfigError(f"env.id={target} is an app: env.args {sorted(args)} cannot reach its environment")
        return obj
    hints = typing.get_type_hints(obj.step)
    action_cls = hints.get("action")
    obs_cls = typing.get_type_hints(obj.reset).get("return") or hints.get("return")
    if action_cls is None or obs_cls is None:
        raise ConfigError(f"{target}: annotate step(self, action: MyAction) -> MyObservation (openenv's own rule)")
    return create_app(functools.partial(obj, **args), action_cls, obs_cls, env_name=attr, max_concurrent_envs=1)


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def main(spec: dict) -> None:
    import uvicorn

    threading.Thread(target=_exit_with_parent, args=(spec["parent"],), daemon=True).start()
    for p in reversed(spec.get("path", [])):
        sys.path.insert(0, p)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    os.environ["OFFSTEP_ENV_PORT"] = str(port)  # for an environment that wants to know it
    app = build_app(spec["id"], spec.get("args", {}))
    with open(spec["port_file"] + ".tmp", "w") as f:
        f.write(str(port))
    os.replace(spec["port_file"] + ".tmp", spec["port_file"])
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws="websockets", timeout_graceful_shutdown=2))
    server.run(sockets=[sock])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
