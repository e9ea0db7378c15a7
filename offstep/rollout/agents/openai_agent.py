"""Agents written against the OpenAI API as rollouts: rows whose ``agent_name`` is ``openai``.

The agent is a Python function loaded from a file, ``async def rollout(client, row) -> float |
dict``: ``client`` is an ``openai.AsyncOpenAI`` on the replica's endpoint
(``offstep.rollout.agents.openai_server``), its own session for this rollout; ``row`` holds the row's
``messages``, ``data_source``, ``ground_truth``, ``extra_info`` and the served ``model`` name. What
it returns is the reward (a number, or a dict with ``score`` and extras, as ``compute_score``'s).
Each row is rolled out ``rollout.n`` times, every rollout concurrently on one event loop; its
sample is what its session recorded (``offstep.rollout.agents.openai_record``). docs/openai-agents.md.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable

from offstep.batch import AgentStats, Sample
from offstep.config.schema import AgentConfig
from offstep.errors import RewardError, ToolConfigError
from offstep.rewards.registry import score_of
from offstep.rollout.agents.openai_server import OpenAIServer
from offstep.rollout.agents.tools import IMPORT_TIMEOUT_S, import_file
from offstep.rollout.types import SamplingParams

KEYS = {
    "path": "rollout.agent.openai_path",
    "name": "rollout.agent.openai_name",
    "timeout": "rollout.agent.tool_timeout_s",
}
MODEL_NAME = "policy"  # the model name the endpoint serves (row["model"])
SIGNATURE = "async def {}(client, row) -> float | dict"


class AgentConfigError(ToolConfigError):
    """The agent file or function cannot be used (found before any worker starts)."""


class AgentError(RewardError):
    """An agent function failed during a rollout, or returned no usable reward."""


def load_agent(
    path: str | None, name: str = "rollout", timeout_s: float | None = IMPORT_TIMEOUT_S, keys: dict = KEYS
) -> Callable[..., Any]:
    """The ``async`` function ``name`` of the Python file ``path`` (imported within ``timeout_s``
    seconds); raises :class:`ToolConfigError` naming the setting and the fix."""
    sig = SIGNATURE.format(name)
    if not path:
        raise AgentConfigError(
            f"{keys['path']} is not set: rows with agent_name=openai are answered by an agent "
            f"function. Fix: set {keys['path']} to a Python file that defines {sig}"
        )
    module = import_file(path, timeout_s, keys, "agent file", sig)
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        found = sorted(k for k, v in vars(module).items() if inspect.iscoroutinefunction(v) and not k.startswith("_"))
        raise AgentConfigError(
            f"{path} has no function {name!r} ({keys['name']}); its async functions are {found}. "
            f"Fix: set {keys['name']} to one of them, or define {sig}"
        )
    if not inspect.iscoroutinefunction(fn):
        raise AgentConfigError(
            f"{keys['name']}={name} in {path} is not async: the endpoint's client is "
            f"openai.AsyncOpenAI. Fix: define it as {sig}"
        )
    try:
        inspect.signature(fn).bind(None, {})
    except TypeError as exc:
        raise AgentConfigError(
            f"{name} in {path} cannot be called as {name}(client, row): {exc}. Fix: define {sig}"
        ) from exc
    return fn


def agent_row(request) -> dict:
    """What the agent function gets as ``row`` (a ``replica_spec.Request``)."""
    return {
        "messages": [dict(m) for m in request.messages],
        "data_source": request.data_source,
        "ground_truth": request.ground_truth,
        "extra_info": dict(request.extra_info),
        "model": MODEL_NAME,
    }


class OpenAIRunner:
    """Runs the OpenAI agents of a rollout worker's generation calls (one per worker)."""

    def __init__(self, spec: AgentConfig, tokenizer, eos_ids):
        self.spec, self.tok, self.eos = spec, tokenizer, list(eos_ids)
        self.env = getattr(spec, "env", None)  # env.*: an environment's rollouts (offstep.envs)
        if self.env is not None:
            from offstep.envs.rows import rollouts

            self.fn = rollouts(self.env)
        else:
            self.fn = load_agent(spec.openai_path, spec.openai_name, spec.tool_timeout_s)

    def run(self, engine, requests: list, params: SamplingParams, seed: int, progress=None) -> list[Sample]:
        """``params.n`` rollouts per request, request-major, through an endpoint that serves for the
        length of this call; the samples, scored with what the agent returned."""
        server = OpenAIServer(
            engine,
            self.tok,
            self.eos,
            self.spec.format,
            params.max_new_tokens,
            (MODEL_NAME,),
            sampling=params,
            seed=seed,
        ).start(engine_thread=False)
        try:
            outcomes = server.drive(lambda: self._all(server, requests, params.n, progress))
        finally:
            server.close()
        if server.batcher.error is not None:  # the agents saw 500s; the run must not go on as if they had not
            raise server.batcher.error
        return [self.sample(requests[i // params.n], *outcome, engine.version) for i, outcome in enumerate(outcomes)]

    async def _all(self, server: OpenAIServer, requests: list, n: int, progress) -> list:
        import httpx

        async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as http:

            async def one(i: int):
                out = await self.rollout(server, http, requests[i // n])
                if progress is not None:
                    progress.advance()
                return out

            return await asyncio.gather(*(one(i) for i in range(len(requests) * n)))

    async def rollout(self, server: OpenAIServer, http, r) -> tuple:
        """One rollout of row ``r`` (a ``replica_spec.Request``) in a session of its own on ``server``:
        the session and what the agent returned. An environment's failed rollout (``env.*``) is
        counted and tried again in a fresh session; one that failed for good drops its group (no
        session: ``offstep.envs.failures``) or stops the run."""
        if self.env is None:
            return await self._rollout(server, http, r)
        from offstep.envs.failures import ERRORS, FAILED, TIMEOUTS, EnvRolloutFailed

        counts = {ERRORS: 0.0, TIMEOUTS: 0.0}
        tries = 1 + (self.env.retries if self.env.on_error == "retry" else 0)
        for attempt in range(tries):
            try:
                session, result = await self._rollout(server, http, r)
            except AgentError as exc:
                if not isinstance(exc.__cause__, EnvRolloutFailed):
                    raise
                counts[TIMEOUTS if exc.__cause__.timed_out else ERRORS] += 1
                if attempt + 1 == tries and getattr(self.spec, "drop_failed", False):
                    return None, {"score": 0.0, FAILED: 1.0, **counts}  # its group leaves the batch
                if attempt + 1 == tries:
                    raise AgentError(
                        f"env {self.env.kind}:{self.env.id} failed {tries} time(s) on row "
                        f"{r.extra_info.get('index', r.uid)!r} (env.on_error={self.env.on_error}, "
                        f"env.retries={self.env.retries}): {exc.__cause__}"
                    ) from exc.__cause__
                continue
            return session, {**result, **counts}
        raise AssertionError("unreachable")

    async def _rollout(self, server: OpenAIServer, http, r) -> tuple:
        import openai

        key = server.open_session()
        # max_retries=0: a retried call would be recorded twice
        client = openai.AsyncOpenAI(
            base_url=server.base_url(key), api_key=server.token, max_retries=0, http_client=http
        )
        try:
            result = await self.fn(client, agent_row(r))
        except Exception as exc:
            raise AgentError(
                f"the agent {self.spec.openai_name!r} in {self.spec.openai_path} raised on row "
                f"{r.extra_info.get('index', r.uid)!r}: {type(exc).__name__}: {exc}. Fix: make the "
                "agent handle every row (give failures a low reward instead of raising)"
            ) from exc
        finally:
            session = server.close_session(key)
        return session, result

    def sample(self, r, session, result, version: int) -> Sample:
        if session is None:  # a dropped rollout (env.on_error): a placeholder its group's batch filters out
            return Sample(
                uid=r.uid,
                prompt_ids=list(self.eos[:1]),
                response_ids=list(self.eos[:1]),
                rollout_logprobs=[0.0],
                finish_reason="abort",
                score=0.0,
                version=version,
                data_source=r.data_source,
                reward_extra=dict(result),
                loss_mask=[0],
            )
        where = (
            f"the agent {self.spec.openai_name!r} in {self.spec.openai_path} (row {r.extra_info.get('index', r.uid)!r})"
        )
        try:
            score, extra = score_of(result)
        except ValueError as exc:
            raise AgentError(
                f"{where} {exc}. Fix: return the reward, a finite number or a dict with a numeric 'score'"
            ) from None
        t = session.trajectory()
        if t is None or not t.response_ids:
            raise AgentError(
                f"{where} sampled no token from the endpoint: a rollout needs at least one call to "
                f"client.chat.completions.create or client.completions.create"
            )
        stats = AgentStats(
            turns=t.turns,
            tool_calls=t.tool_calls,
            attempts=t.attempts,
            well_formed=t.tool_calls,
            prefix_breaks=session.breaks,
        )
        return Sample(
            uid=r.uid,
            prompt_ids=t.prompt_ids,
            response_ids=t.response_ids,
            rollout_logprobs=t.logprobs,
            finish_reason=t.finish_reason,
            score=score,
            version=t.versions[0] if t.versions else version,
            data_source=r.data_source,
            text=self.tok.decode(t.response_ids, skip_special_tokens=True),
            reward_extra=extra,
            loss_mask=t.loss_mask,
            agent=stats,
        )
