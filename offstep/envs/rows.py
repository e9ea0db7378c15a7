"""What offstep takes from an environment: its tasks as prompt rows, and its rollout as the agent
function of those rows (``agent_name=openai``, ``offstep.rollout.agents.openai_agent``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from offstep.config.schema import AgentConfig

KINDS = ("verifiers", "openenv")
OPENAI_AGENT = "openai"


class EnvLoadError(ValueError):
    """The environment named by ``env.*`` cannot be loaded (found before any worker starts)."""


def _check(spec) -> None:
    if spec.kind not in KINDS:
        raise EnvLoadError(f"env.kind={spec.kind!r} is not one of {list(KINDS)}. Fix: env.kind=verifiers or openenv")
    if not spec.id:
        raise EnvLoadError(f"env.kind={spec.kind} needs env.id (the environment to load)")
    if spec.on_error not in ("retry", "drop"):
        raise EnvLoadError(f"env.on_error={spec.on_error!r} is not retry or drop")
    if spec.retries < 0 or spec.timeout_s <= 0 or spec.max_concurrent < 0 or spec.val_size < 0:
        raise EnvLoadError("env.retries, env.max_concurrent and env.val_size must be >= 0, env.timeout_s > 0")


def rollouts(spec) -> Callable[..., Any]:
    """The environment's agent function, ``await fn(client, row) -> dict`` (score and reward parts)."""
    _check(spec)
    try:
        if spec.kind == "verifiers":
            from offstep.envs.verifiers_env import VerifiersRollouts

            return VerifiersRollouts(spec)
        from offstep.envs.openenv_env import OpenEnvRollouts

        return OpenEnvRollouts(spec)
    except ImportError as exc:
        raise EnvLoadError(
            f"env.kind={spec.kind} env.id={spec.id}: {type(exc).__name__}: {exc}. Fix: install the "
            f"environment's package (and {spec.kind}), or put its folder in env.path"
        ) from exc
    except Exception as exc:  # the library's own error, named
        raise EnvLoadError(
            f"env.kind={spec.kind} env.id={spec.id} failed to load: {type(exc).__name__}: {exc}"
        ) from exc


@dataclass
class EnvAgent(AgentConfig):
    env: Any = None  # the EnvConfig whose rollouts answer the rows
    drop_failed: bool = False  # a rollout that failed for good drops its group (batch mode) instead of stopping the run


def split(rows: list, val_size: int) -> tuple[list, list]:
    if val_size >= len(rows):
        raise EnvLoadError(f"env.val_size={val_size} holds out all {len(rows)} tasks of the environment")
    return (rows[: len(rows) - val_size], rows[len(rows) - val_size :]) if val_size else (rows, [])


def env_agent(agent_cfg, spec, fully_async: bool = False):
    """``rollout.agent`` carrying ``env`` to the rollout workers (their OpenAI runner loads it). The
    failure rule (docs/environments.md): a rollout that failed for good (at once with ``drop``,
    after ``env.retries`` with ``retry``) drops its group in batch mode; in fully_async, whose stream
    trains groups as they finish, it stops the run, and ``drop`` is refused before start."""
    import dataclasses

    if fully_async and spec.on_error == "drop":
        raise EnvLoadError(
            "env.on_error=drop is not supported with pipeline.mode=fully_async (its stream does not "
            "drop groups). Fix: env.on_error=retry (a rollout still failing after env.retries stops "
            "the run), or pipeline.mode=batch"
        )
    out = EnvAgent(**{f.name: getattr(agent_cfg, f.name) for f in dataclasses.fields(agent_cfg)})
    out.env, out.drop_failed = spec, not fully_async
    return out
