"""An environment's tasks as the run's prompt records (``env.*``; the driver, before Ray)."""

from __future__ import annotations

from offstep.data.dataset import PromptRecord
from offstep.envs.rows import OPENAI_AGENT, env_agent, rollouts, split


def env_inputs(cfg) -> tuple[list[PromptRecord], list[PromptRecord], object]:
    """The training and validation records of ``cfg.env`` (loaded once here, so that an environment
    that fails to load stops the run with its error before any worker starts), and the agent spec
    that makes the rollout workers answer them with the environment's rollouts."""
    spec = cfg.env
    agent = env_agent(cfg.rollout.agent, spec, cfg.pipeline.mode == "fully_async")  # its refusals first
    fn = rollouts(spec)
    prompts = fn.prompts()
    if hasattr(fn, "close"):
        fn.close()
    source = f"{spec.kind}:{spec.id}"
    records = [
        PromptRecord(
            index=i,
            data_source=source,
            messages=m,
            ground_truth=None,
            extra_info={"env_task": i, "index": i},
            agent_name=OPENAI_AGENT,
        )
        for i, m in enumerate(prompts)
    ]
    train, val = split(records, spec.val_size)
    return train, val, agent
