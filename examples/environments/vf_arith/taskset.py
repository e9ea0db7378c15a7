"""The tasks, their rewards and their tool (see the package's docstring)."""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: int
    fail_every: int = 0  # a failing environment, for tests: every n-th scoring raises


_scored = [0]


class ArithConfig(vf.TasksetConfig):
    size: int = 32
    fail_every: int = 0
    tools: bool = False
    seed: int = 0


class Calculator(vf.Toolset):
    @vf.tool
    def add(self, a: int, b: int) -> str:
        """Add two integers."""
        return str(int(a) + int(b))


class ArithTask(vf.Task[ArithData]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ArithData, trace: vf.Trace) -> float:
        _scored[0] += 1
        if task.fail_every and _scored[0] % task.fail_every == 0:
            raise RuntimeError("the environment failed (fail_every)")
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and int(numbers[-1]) == task.answer)

    @vf.reward(weight=0.1)
    async def brief(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or "") < 40)


class ArithTaskset(vf.Taskset[ArithTask, ArithConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            a, b = rng.randint(1, 20), rng.randint(1, 20)
            yield ArithTask(
                ArithData(
                    id=f"sum-{i}",
                    prompt=f"What is {a} + {b}? Answer with the number.",
                    answer=a + b,
                    fail_every=self.config.fail_every,
                ),
                self.config.task,
            )
