"""verifiers' own chat program (its ``null`` harness: the chat loop, MCP tools and all) run with
this Python rather than in a ``uv`` environment of its own, which would be fetched from the network
at the first rollout. The program's packages (openai, mcp, httpx, httpx2, tenacity) are offstep's
dependencies when verifiers is installed. Registered as the harness id ``offstep_vf_chat``."""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile

from verifiers.v1.harnesses.null.harness import NullHarness, NullHarnessConfig

HARNESS_ID = "offstep_vf_chat"


class _ThisPython:
    """A runtime whose PEP 723 scripts run with ``sys.executable`` (subprocess runtimes only)."""

    def __init__(self, runtime):
        self._runtime = runtime

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    async def prepare_uv_script(self, script, env=None, *, activate=True) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        path = os.path.join(tempfile.gettempdir(), f"offstep-vf-{hashlib.sha256(data).hexdigest()[:16]}.py")
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return [sys.executable, path]


class LocalChatHarness(NullHarness):
    """``NullHarness`` with its program on this interpreter."""

    async def setup(self, runtime) -> None:
        return None

    async def launch(self, ctx, trace, runtime, *args, **kwargs):
        return await super().launch(ctx, trace, _ThisPython(runtime), *args, **kwargs)


LocalChatConfig = NullHarnessConfig
__all__ = ["LocalChatHarness"]
