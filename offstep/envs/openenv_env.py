"""OpenEnv environments (``env.kind=openenv``; openenv-core >= 0.3): servers offstep runs, an agent
loop offstep writes.

``env.id`` is ``module:attr``: an OpenEnv ``Environment`` subclass (served with openenv-core's
``create_app``, built with ``env.args``' other keys) or a package's own app. Task ``i`` is an episode
reset with ``seed=i``; its first observation is the prompt. One rollout plays one episode on a
server of the pool (``offstep.envs.openenv_pool``) over openenv's WebSocket client: each
observation becomes a user message, the model's reply (through the replica's endpoint, recorded
token for token) becomes the action, until the environment says done or ``max_turns`` replies;
the reward is the sum of the step results' rewards.

offstep's keys in ``env.args``: ``size`` (tasks, default 64), ``max_turns`` (default 4),
``system_prompt``, ``action_field`` (default: the action's one string field),
``observation_field`` (default: the first of prompt/text/message/content/question in the
observation; else the observation as JSON).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

from offstep.envs.failures import EnvRolloutFailed
from offstep.envs.openenv_pool import ServerPool
from offstep.errors import ConfigError

OWN = ("size", "max_turns", "system_prompt", "action_field", "observation_field")
TEXT_FIELDS = ("prompt", "text", "message", "content", "question")
NOT_SHOWN = ("done", "reward", "metadata")


def action_field(schema: dict, target: str) -> str:
    """The action's one string field (the reply goes there)."""
    props = {k: v for k, v in schema.get("properties", {}).items() if k != "metadata"}
    strings = [k for k, v in props.items() if v.get("type") == "string"]
    if len(strings) != 1:
        raise ConfigError(
            f"{target}: its action has string fields {strings} (of {sorted(props)}); name the one the "
            "model's reply fills: +env.args.action_field=NAME"
        )
    return strings[0]


def observation_text(obs: dict, field: str | None) -> str:
    if field:
        return str(obs.get(field, ""))
    for k in TEXT_FIELDS:
        if isinstance(obs.get(k), str):
            return obs[k]
    return json.dumps({k: v for k, v in obs.items() if k not in NOT_SHOWN}, sort_keys=True)


class OpenEnvRollouts:
    """The agent function of an OpenEnv environment: ``await self(client, row)``."""

    def __init__(self, spec):
        self.spec = spec
        args = dict(spec.args)
        self.size, self.max_turns = int(args.get("size", 64)), int(args.get("max_turns", 4))
        self.system = args.get("system_prompt")
        self.obs_field = args.get("observation_field")
        self.pool = ServerPool(
            spec.id, {k: v for k, v in args.items() if k not in OWN}, list(spec.path), spec.max_concurrent
        )
        first = self.pool.start()  # a server that fails to start stops the run here, with its error
        try:
            with urllib.request.urlopen(first.url + "/schema", timeout=30) as r:
                schema = json.load(r)
            self.action_field = args.get("action_field") or action_field(schema.get("action", {}), spec.id)
        except Exception:
            self.pool.close()
            raise
        self.pool.release(first)

    def _messages(self, obs: dict) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return sys_msg + [{"role": "user", "content": observation_text(obs, self.obs_field)}]

    def prompts(self) -> list[list[dict]]:
        """Each task's first observation (reset with its seed), as chat messages."""

        async def first_observations():
            from openenv.core.generic_client import GenericEnvClient

            server = await self.pool.acquire()
            try:
                async with GenericEnvClient(base_url=server.url, message_timeout_s=self.spec.timeout_s) as env:
                    return [self._messages((await env.reset(seed=i)).observation) for i in range(self.size)]
            finally:
                self.pool.release(server)

        return asyncio.run(first_observations())

    async def __call__(self, client, row) -> dict:
        task = int(row["extra_info"]["env_task"])
        server = await self.pool.acquire()
        try:
            async with asyncio.timeout(self.spec.timeout_s):
                reward = await self._episode(client, row["model"], server.url, task)
        except TimeoutError as exc:
            await asyncio.to_thread(self.pool.kill, server)  # it may still be inside the step
            raise EnvRolloutFailed(f"the episode ran over env.timeout_s={self.spec.timeout_s}", True) from exc
        finally:
            self.pool.release(server)
        return {"score": reward}

    async def _episode(self, client, model: str, url: str, task: int) -> float:
        from openenv.core.generic_client import GenericEnvClient

        env = GenericEnvClient(base_url=url, message_timeout_s=self.spec.timeout_s + 5)
        try:
            result = await _env_call(env.reset(seed=task))
            messages, total, turns = self._messages(result.observation), 0.0, 0
            while not result.done and turns < self.max_turns:
                reply = await client.chat.completions.create(model=model, messages=messages)
                text = reply.choices[0].message.content or ""
                turns += 1
                result = await _env_call(env.step({self.action_field: text}))
                total += float(result.reward or 0.0)
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": observation_text(result.observation, self.obs_field)},
                ]
            return total
        finally:
            await env.disconnect()

    def close(self) -> None:
        self.pool.close()


async def _env_call(coro):
    """An environment call; its failure is the environment's (counted, retried or dropped)."""
    try:
        return await coro
    except (asyncio.CancelledError, TimeoutError):
        raise
    except Exception as exc:
        raise EnvRolloutFailed(f"the OpenEnv server failed: {type(exc).__name__}: {exc}") from exc
