"""verifiers environments (``env.kind=verifiers``; verifiers >= 0.4, its ``verifiers.v1`` stack).

The environment is loaded as verifiers loads it (``load_environment`` over ``env.id`` and
``env.args``); its taskset gives the prompts, and one rollout is one verifiers episode
(``Env.run_episode``): its harness (verifiers' chat program, with the taskset's tools over MCP)
talks through verifiers' interception server to the replica's endpoint, whose session records
every token. The taskset's ``@reward`` parts are the reward (their weighted sum, as verifiers'
``Trace.reward``), each also reported as ``reward/<name>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from typing import Any

from offstep.envs.failures import EnvRolloutFailed

TOKEN_VAR = "OFFSTEP_ENDPOINT_TOKEN"  # verifiers reads the endpoint's key from a variable


def _register_harness() -> str:
    from offstep.envs import vf_chat

    sys.modules.setdefault(vf_chat.HARNESS_ID, vf_chat)  # verifiers imports harnesses by id
    return vf_chat.HARNESS_ID


def load(spec) -> Any:
    """The verifiers ``Env`` of ``spec`` (an ``EnvConfig``), on local subprocess runtimes."""
    import verifiers.v1 as vf

    for p in spec.path:
        if p not in sys.path:
            sys.path.insert(0, os.path.abspath(p))
    harness = _register_harness()
    raw = {
        "taskset": {"id": spec.id, **dict(spec.args)},
        "agent": {"harness": {"id": harness}, "runtime": {"type": "subprocess"}},
        "timeout": {"episode": spec.timeout_s},
    }  # verifiers' own retries stay off: offstep's env.retries
    return vf.load_environment(vf.resolve_env_config(raw))


def tasks(env) -> list:
    """The taskset's tasks, in its order (a bounded view; an infinite taskset is cut at 100,000)."""
    ts = env.taskset if env.taskset.bounded else env.taskset.take(100_000)
    return list(ts)


def task_messages(task) -> list[dict]:
    """The chat messages a task's episode starts from (system prompt, then the prompt)."""
    data = task.data
    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    else:
        for m in data.prompt or []:
            d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
            out.append({"role": d.get("role", "user"), "content": d.get("content") or ""})
    return out


class VerifiersRollouts:
    """The agent function of a verifiers environment: ``await self(client, row)``."""

    def __init__(self, spec):
        self.spec = spec
        self.env = load(spec)
        self.tasks = tasks(self.env)
        self._gate: asyncio.Semaphore | None = None

    def prompts(self) -> list[list[dict]]:
        return [task_messages(t) for t in self.tasks]

    async def __call__(self, client, row) -> dict:
        from verifiers.v1 import ModelContext
        from verifiers.v1.configs.client import EvalClientConfig

        if self._gate is None and self.spec.max_concurrent:
            self._gate = asyncio.Semaphore(self.spec.max_concurrent)
        task = self.tasks[int(row["extra_info"]["env_task"])]
        os.environ[TOKEN_VAR] = client.api_key
        ctx = ModelContext(
            model=row["model"],
            client=EvalClientConfig(base_url=str(client.base_url).rstrip("/"), api_key_var=TOKEN_VAR),
        )
        async with self._gate if self._gate is not None else contextlib.nullcontext():
            try:
                async with asyncio.timeout(self.spec.timeout_s + 30):  # verifiers' own deadline first
                    async with self.env.serving():
                        episode = await self.env.run_episode(task, ctx)
            except TimeoutError as exc:
                raise EnvRolloutFailed(f"the episode ran over env.timeout_s={self.spec.timeout_s}", True) from exc
        if not episode.ok or not episode.traces:
            errors = [e for t in episode.traces for e in t.errors] + list(episode.errors)
            what = "; ".join(f"{e.type}: {e.message}" for e in errors[-3:]) or "no trace"
            timed_out = episode.is_timeout or any(t.is_timeout for t in episode.traces)
            raise EnvRolloutFailed(f"verifiers episode failed ({what})", timed_out)
        trace = episode.traces[-1]
        parts = {f"reward/{k}": r.value for k, r in trace.rewards.items() if r is not None}
        return {"score": float(trace.reward), **parts}
