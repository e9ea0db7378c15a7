"""The driver's signal handlers (``offstep/pipeline/stop.py``), in a process of their own: SIGTERM
asks for a stop after the current step, SIGUSR1 prints the stacks of the driver's threads and of
its pending asyncio tasks and leaves the run going."""

from __future__ import annotations

import subprocess
import sys

CHILD = r'''
import asyncio, os, signal, sys
from offstep.pipeline.stop import StopRequest

async def waiting_for_a_generation(stop):
    while not stop.requested:
        await asyncio.sleep(0.05)

async def main():
    stop = StopRequest(lambda text: print(text, file=sys.stderr, flush=True))
    stop.install()
    task = asyncio.ensure_future(waiting_for_a_generation(stop))
    await asyncio.sleep(0.1)
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.sleep(0.2)
    print("still running", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(task, 10)
    print("stopped", stop.requested, flush=True)

asyncio.run(main())
'''


def test_sigusr1_dumps_threads_and_tasks_and_sigterm_requests_a_stop():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "SIGUSR1: the driver's threads, then its asyncio tasks" in out.stderr
    assert "Current thread" in out.stderr or "Thread 0x" in out.stderr  # faulthandler's thread dump
    assert "in waiting_for_a_generation" in out.stderr and "in sleep" in out.stderr  # the task's whole await chain
    assert "SIGTERM received; stopping after this step" in out.stderr
    assert out.stdout.split("\n")[:2] == ["still running", "stopped True"]
