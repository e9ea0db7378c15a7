"""Signals during a run. Ctrl-C and SIGTERM: finish the current step, write a checkpoint (when
``trainer.save_freq > 0``) and stop; a second Ctrl-C stops at once. SIGUSR1: print where the
driver is (every thread's stack and every asyncio task's) to stderr, and go on: for a run that
seems stuck, ``kill -USR1 <pid>``."""

from __future__ import annotations

import asyncio
import faulthandler
import signal
import sys
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

        handlers = {
            signal.SIGINT: (request, signal.SIGINT),
            signal.SIGTERM: (request, signal.SIGTERM),
            signal.SIGUSR1: (dump_stacks, loop),
        }
        for sig, (handler, arg) in handlers.items():
            try:
                loop.add_signal_handler(sig, handler, arg)
            except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
                pass


def dump_stacks(loop: asyncio.AbstractEventLoop) -> None:
    """Every thread's stack, then every pending asyncio task's, to stderr."""
    print("offstep: SIGUSR1: the driver's threads, then its asyncio tasks", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for task in asyncio.all_tasks(loop):
        print(f"{task!r:.300}", file=sys.stderr)
        for line in _awaiting(task.get_coro()):
            print(f"  {line}", file=sys.stderr)
    sys.stderr.flush()


def _awaiting(coro) -> list[str]:
    """A suspended coroutine's whole await chain, outermost first (``Task.print_stack`` shows
    only the outermost frame): each coroutine's file, line and function, then what the innermost
    one waits on."""
    lines = []
    while coro is not None and getattr(coro, "cr_frame", None) is not None:
        f = coro.cr_frame
        lines.append(f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}")
        coro = coro.cr_await
    if coro is not None:
        lines.append(f"waiting on {coro!r:.300}")
    return lines
