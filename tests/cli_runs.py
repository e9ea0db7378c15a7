"""Running ``offstep train`` as a user does, in a process (and session) of its own, for tests that
stop, kill or wait on it, and the reward files that make a run slow, hang or kill its worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def cli(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "offstep.cli", "train", *args],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        **kw,
    )


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    t0 = time.time()
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (rc {proc.returncode}) before {path} appeared: {proc.stderr.read()}")
        if time.time() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.1)


# a reward that makes each step take a while (a run to interrupt)
SLOW_REWARD = '''
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    time.sleep(0.05)
    return 0.0
'''


# a reward that kills the rollout worker's process once, in the middle of a generation
DYING_REWARD = '''
import os
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    marker = MARKER
    # solution_str "": the driver's dry call of the scorer before any worker starts, not a sample.
    if solution_str and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)  # the rollout worker process dies in the middle of a generation
    return 0.0
'''


# a reward that never returns
HANGING_REWARD = '''
import time
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    time.sleep(3600)
'''
