"""verl's tool API (``verl.tools.base_tool.BaseTool``, ``verl.tools.schemas``), for a user's verl tool
class where verl is not installed: offstep does not depend on verl, and a tool module written for
verl starts with ``from verl.tools.base_tool import BaseTool``. :func:`install` registers these
names as the modules ``verl.tools.base_tool``, ``verl.tools.schemas`` and
``verl.utils.rollout_trace`` unless a real verl is importable, which is then used as it is.

The protocol is verl's (``verl/tools/base_tool.py``): ``create`` an instance for a call (returning
its id, or the id and a response), ``execute(instance_id, parameters)`` returning the response, a
step reward and metrics, ``calc_reward`` and ``release``. Schemas are pydantic models, as in verl,
so that a tool reading ``self.tool_schema.function.name`` works unchanged."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any, Optional
from uuid import uuid4

from pydantic import BaseModel, ConfigDict


class OpenAIFunctionSchema(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str = ""
    parameters: dict = {"type": "object", "properties": {}, "required": []}
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str = "function"
    function: OpenAIFunctionSchema


class ToolResponse(BaseModel):
    text: Optional[str] = None
    image: Optional[Any] = None
    video: Optional[Any] = None


class BaseTool:
    """verl's base class: a subclass overrides ``create``, ``execute``, ``calc_reward`` and ``release``."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__}: no tool schema (give tool_schema in the tool config)")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema

    async def create(self, instance_id: Optional[str] = None, **kwargs) -> tuple[str, ToolResponse]:
        return instance_id or str(uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


def rollout_trace_op(fn):
    """verl's tracing decorator: offstep records tool calls itself (the timeline's tool stage)."""
    return fn


def install() -> None:
    """Make ``verl.tools.base_tool``, ``verl.tools.schemas`` and ``verl.utils.rollout_trace``
    importable from this module, unless verl itself is."""
    if "verl.tools.base_tool" in sys.modules or importlib.util.find_spec("verl") is not None:
        return
    names = {
        "verl": {},
        "verl.tools": {},
        "verl.utils": {},
        "verl.tools.schemas": {
            "OpenAIFunctionSchema": OpenAIFunctionSchema,
            "OpenAIFunctionToolSchema": OpenAIFunctionToolSchema,
            "ToolResponse": ToolResponse,
        },
        "verl.tools.base_tool": {
            "BaseTool": BaseTool,
            "OpenAIFunctionToolSchema": OpenAIFunctionToolSchema,
            "ToolResponse": ToolResponse,
        },
        "verl.utils.rollout_trace": {"rollout_trace_op": rollout_trace_op},
    }
    for name, attrs in names.items():
        module = types.ModuleType(name, f"offstep's stand-in for {name} (offstep/rollout/agents/verl_tool_api.py)")
        module.__path__ = []  # a package, so that its submodules resolve
        module.__dict__.update(attrs)
        sys.modules[name] = module
    for name in names:
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])
