"""Ctrl-C and SIGTERM during a run: finish the current step, write a checkpoint (when
``trainer.save_freq > 0``) and stop. A second Ctrl-C stops at once."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable


class StopRequest:
    def __init__(self, log: Callable[[str], None]):
        self.log = log
        self.requested = False

    def install(self) -> None:
        """Handle the signals in the running event loop (a no-op off the main thread)."""
        loop = asyncio.get_running_loop()

        def request(sig: signal.Signals) -> None:
            if self.requested:
                return
            self.requested = True
            loop.remove_signal_handler(signal.SIGINT)  # the next Ctrl-C raises KeyboardInterrupt
            self.log(f"offstep: {sig.name} received; stopping after this step (Ctrl-C again to abort)")

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, request, sig)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass
