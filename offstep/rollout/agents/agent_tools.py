"""The tools an agent loop offers the model: from a verl tool config (``rollout.agent.tool_config_path``,
:mod:`offstep.rollout.agents.verl_tools`), or offstep's tool functions (``rollout.agent.tools`` from
``tools_path`` and the built-in ones, :mod:`offstep.rollout.agents.tools`)."""

from __future__ import annotations

from offstep.config.schema import AgentConfig
from offstep.rollout.agents.tools import Tool, load_tools
from offstep.rollout.agents.verl_tools import load_verl_tools


def agent_tools(spec: AgentConfig) -> list[Tool]:
    """The tools of the agent settings ``spec``."""
    if spec.tool_config_path:
        return load_verl_tools(spec.tool_config_path, spec.tool_timeout_s)
    return load_tools(spec.tools_path, list(spec.tools), spec.tool_timeout_s)
