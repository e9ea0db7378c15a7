"""Untrusted code run in a bubblewrap sandbox with limits ([docs/sandbox.md](../../docs/sandbox.md)).

``Sandbox(limits).run(code, stdin) -> Result``; ``problem()`` says why no sandbox can run here
(None: it can). Nothing falls back to running code unsandboxed. ``shared()`` is the process's
sandbox, which the code rewards and the ``python`` tool use, set up by ``configure``.
"""

from __future__ import annotations

import threading

from offstep.sandbox.bwrap import SYSTEM_PYTHON
from offstep.sandbox.launch import problem
from offstep.sandbox.limits import Limits
from offstep.sandbox.run import Result, Sandbox, SandboxUnavailable
from offstep.sandbox.stats import Execution, SandboxLog

__all__ = [
    "Limits",
    "Result",
    "Sandbox",
    "SandboxUnavailable",
    "Execution",
    "SandboxLog",
    "problem",
    "shared",
    "configure",
    "SYSTEM_PYTHON",
]

_lock = threading.Lock()
_shared: Sandbox | None = None


def configure(limits: Limits = Limits(), concurrency: int = 2, python: str = SYSTEM_PYTHON) -> Sandbox:
    """Set this process's sandbox (a rollout worker does it at start, from the ``sandbox`` config);
    executions recorded so far stay in its log."""
    global _shared
    with _lock:
        log = _shared.log if _shared is not None else None
        _shared = Sandbox(limits, concurrency, python, log)
        return _shared


def shared() -> Sandbox:
    """This process's sandbox (default limits until ``configure`` is called)."""
    global _shared
    with _lock:
        if _shared is None:
            _shared = Sandbox()
        return _shared
