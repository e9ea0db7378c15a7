"""The environment's types and its episodes (see the package's docstring)."""

from __future__ import annotations

import fcntl
import os
import random
import re
import time
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class ArithAction(Action):
    answer: str = Field(..., description="the reply: its last integer is the answer")


class ArithObservation(Observation):
    prompt: str = Field(default="", description="the question, or what the last answer got")


def _count(path: str) -> int:
    """The n-th step over every server of the run (a counter file under a lock)."""
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = int(f.read() or 0) + 1
        f.seek(0)
        f.truncate()
        f.write(str(n))
        return n


class ArithEnvironment(Environment[ArithAction, ArithObservation, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, tries: int = 2, fail_every: int = 0, hang_at: int = 0, record: str = ""):
        super().__init__()
        self.tries, self.fail_every, self.hang_at, self.record = tries, fail_every, hang_at, record
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._answer, self._tried = 0, 0  # tries of this episode (the server counts state.step_count too)
        if record:
            self._log(f"server {os.getpid()} {os.environ.get('OFFSTEP_ENV_PORT', '')}")

    def _log(self, line: str) -> None:
        with open(self.record, "a") as f:
            f.write(line + "\n")

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs) -> ArithObservation:
        rng = random.Random(seed)
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        self._answer, self._tried = a + b, 0
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        return ArithObservation(prompt=f"What is {a} + {b}? Answer with the number.", done=False, reward=0.0)

    def step(self, action: ArithAction, timeout_s: float | None = None, **kwargs) -> ArithObservation:
        self._tried += 1
        if self.fail_every or self.hang_at:
            n = _count(self.record + ".count")
            if self.fail_every and n % self.fail_every == 0:
                self._log(f"error {n}")
                raise RuntimeError(f"the environment failed (step {n}, fail_every={self.fail_every})")
            if n == self.hang_at:
                self._log(f"hang {n}")
                time.sleep(3600)
        numbers = re.findall(r"-?\d+", action.answer)
        right = bool(numbers) and int(numbers[-1]) == self._answer
        done = right or self._tried >= self.tries
        prompt = "Correct." if right else ("Wrong. Try again: answer with the number." if not done else "Wrong.")
        return ArithObservation(prompt=prompt, done=done, reward=1.0 if right else 0.0)

    @property
    def state(self) -> State:
        return self._state
