"""verl's tool configs as offstep tools (``rollout.agent.tool_config_path``; verl's
``actor_rollout_ref.rollout.multi_turn.tool_config_path`` translates to it).

A verl tool config is a YAML file::

    tools:
      - class_name: verl.tools.gsm8k_tool.Gsm8kTool
        config: {type: native}
        tool_schema: {type: function, function: {name: calc_gsm8k_reward, parameters: {...}}}

Each entry becomes one offstep :class:`~offstep.rollout.agents.tools.Tool` whose schema, the one the model
sees, is the entry's ``tool_schema`` as written:

* verl's bundled tools that can run here map onto offstep code doing the same:
  ``Gsm8kTool`` scores the model's answer against the row's ``ground_truth`` (verl's GSM8K rule,
  flexible, and its reply text ``Current parsed answer='..' reward=..``); ``SandboxFusionTool``
  runs the model's ``code`` in offstep's sandbox (docs/sandbox.md) instead of a SandboxFusion
  server. Those that need a service offstep cannot start (search, MCP) or images are refused.
* any other ``class_name`` (``package.module.Class``, importable from the Python path) is a
  user's ``BaseTool`` subclass: its module is imported within ``rollout.agent.tool_timeout_s``
  and, without verl installed, against verl's tool API as :mod:`offstep.rollout.agents.verl_tool_api`
  provides it. It is driven as verl's tool agent loop drives it: for each call ``create`` (with the
  row's ``create_kwargs``), ``execute(instance_id, arguments)``, whose response text the model
  reads, then ``release``, also when ``execute`` raised. Step rewards and ``calc_reward`` are
  not used, as in verl's loop: the row's reward function scores the sample.

The row's ``tools_kwargs`` reach the call beside the model's arguments (offstep's rule, the row's
win); the arguments that the schema names go to ``execute``, the others to ``create``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from offstep.errors import OffstepError, ToolConfigError
from offstep.files import MAX_CONFIG_BYTES, loads_yaml, read_text
from offstep.rewards.registry import CallTimeout, import_within
from offstep.rewards.scorers import gsm8k_score
from offstep.rollout.agents.tools import Tool, ToolError, python

KEY = "rollout.agent.tool_config_path"
GSM8K = "verl.tools.gsm8k_tool.Gsm8kTool"
SANDBOX_FUSION = "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
# verl's bundled tools that need what offstep does not start: refused, saying why
UNSERVED = {
    "verl.tools.search_tool.SearchTool": "it queries a retrieval server (config.retrieval_service_url) that offstep "
    "does not start",
    "verl.tools.mcp_search_tool.MCPSearchTool": "it needs an MCP server that offstep does not start",
    "verl.tools.mcp_base_tool.MCPBaseTool": "it needs an MCP server that offstep does not start",
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": "it returns images, and offstep's tool turns are text",
    "verl.tools.geo3k_tool.Geo3kTool": "its rows are image prompts, and offstep's tool loops do not carry images yet "
    "(single-turn image prompts train: docs/multimodal.md)",
}


def read_tool_config(path: str | Path) -> list[dict]:
    """The entries of a verl tool config, each checked: ``class_name`` a dotted name,
    ``config`` a mapping (or absent), ``tool_schema`` an OpenAI function schema."""
    try:
        doc = loads_yaml(read_text(path, MAX_CONFIG_BYTES))
    except FileNotFoundError:
        raise ToolConfigError(
            f"{KEY}={path}: no such file. Fix: give verl's tool config YAML "
            f"(tools: [{{class_name, config, tool_schema}}])"
        ) from None
    except (OSError, ValueError, OffstepError) as e:
        raise ToolConfigError(f"{KEY}={path} cannot be read as a verl tool config ({e})") from None
    tools = doc.get("tools") if isinstance(doc, dict) else None
    if not isinstance(tools, list) or not tools:
        raise ToolConfigError(
            f"{KEY}={path} has no list under 'tools:' (verl's layout: tools: [{{class_name: "
            f"..., config: {{...}}, tool_schema: {{...}}}}])"
        )
    for i, entry in enumerate(tools):
        where = f"{KEY}={path}, tools[{i}]"
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("class_name"), str)
            or "." not in entry["class_name"]
        ):
            raise ToolConfigError(f"{where}: needs class_name, a dotted name such as {GSM8K}")
        if not isinstance(entry.get("config") or {}, dict):
            raise ToolConfigError(f"{where} ({entry['class_name']}): config must be a mapping")
        schema = entry.get("tool_schema")
        function = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ToolConfigError(
                f"{where} ({entry['class_name']}): tool_schema must be an OpenAI function schema "
                f"{{type: function, function: {{name: ..., parameters: {{...}}}}}}: the schema the "
                f"model sees"
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise ToolConfigError(f"{where} ({entry['class_name']}): tool_schema.function.parameters must be a mapping")
    return tools


def load_verl_tools(path: str | Path, timeout_s: float | None) -> list[Tool]:
    """The tools of the verl tool config ``path`` (see the module's docstring)."""
    tools = []
    for entry in read_tool_config(path):
        cls, schema = entry["class_name"], entry["tool_schema"]
        if cls in UNSERVED:
            raise ToolConfigError(
                f"{KEY}={path}: {cls} cannot run in offstep: {UNSERVED[cls]}. Fix: drop it from "
                f"the config, or write the tool as a BaseTool subclass of your own"
            )
        if cls == GSM8K:
            fn = _gsm8k(schema)
        elif cls == SANDBOX_FUSION:
            fn = _sandbox_fusion(schema)
        else:
            fn = _protocol(_instance(cls, entry.get("config") or {}, schema, path, timeout_s), schema)
        tools.append(Tool(schema["function"]["name"], fn, schema))
    names = [t.name for t in tools]
    if len(set(names)) < len(names):
        raise ToolConfigError(
            f"{KEY}={path}: tool names {sorted({n for n in names if names.count(n) > 1})} appear twice"
        )
    return tools


def _properties(schema: dict) -> set[str]:
    return set((schema["function"].get("parameters") or {}).get("properties") or {})


def _gsm8k(schema: dict):
    """verl's Gsm8kTool: the answer scored against the row's ground truth, the score told back."""
    params = sorted(_properties(schema)) or ["answer"]

    async def calc_gsm8k_reward(**kwargs: Any) -> str:
        answer = kwargs.get("answer", kwargs.get(params[0], ""))
        answer = answer if isinstance(answer, str) else str(answer)
        truth = kwargs.get("ground_truth")
        if truth is None:
            raise ToolError(
                "this row gives no ground_truth (extra_info.tools_kwargs.<tool>.create_kwargs.ground_truth)"
            )
        reward = gsm8k_score(answer if answer.startswith("#### ") else "#### " + answer, truth, method="flexible")
        return f"Current parsed answer={answer!r} reward={reward!r}"

    return calc_gsm8k_reward


def _sandbox_fusion(schema: dict):
    """verl's SandboxFusionTool: the model's program run in offstep's sandbox, its output told back."""
    props = sorted(_properties(schema))
    field = "code" if "code" in props or not props else props[0]

    def run_code(**kwargs: Any) -> str:
        code = kwargs.get(field)
        if not isinstance(code, str):
            raise ToolError(f"'{field}' must be the program, a string")
        return python(code)

    return run_code


def _instance(cls_name: str, config: dict, schema: dict, path, timeout_s: float | None):
    """An instance of the user's tool class ``cls_name`` (``package.module.Class``)."""
    from offstep.rollout.agents import verl_tool_api

    verl_tool_api.install()
    module_name, _, attr = cls_name.rpartition(".")
    fix = (
        f"Fix: make {module_name!r} importable (run from the folder that holds it, or add that folder to "
        f"PYTHONPATH), or correct class_name in {path}"
    )
    try:
        module = sys.modules.get(module_name) or _import(module_name, timeout_s)
    except ModuleNotFoundError as e:
        raise ToolConfigError(f"{KEY}={path}: the tool class {cls_name} cannot be imported ({e}). {fix}") from None
    except CallTimeout:
        raise ToolConfigError(
            f"{KEY}={path}: importing {module_name} took longer than {timeout_s:g} s "
            f"(rollout.agent.tool_timeout_s): make importing it only define the tool"
        ) from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise ToolConfigError(f"{KEY}={path}: importing {module_name} failed: {type(e).__name__}: {e}") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("create", "execute", "release")):
        raise ToolConfigError(
            f"{KEY}={path}: {cls_name} is not a verl tool class (a BaseTool subclass with create, "
            f"execute and release). {fix}"
        )
    from offstep.rollout.agents.verl_tool_api import OpenAIFunctionToolSchema

    try:
        return cls(config, OpenAIFunctionToolSchema.model_validate(schema))
    except Exception as e:  # noqa: BLE001
        raise ToolConfigError(
            f"{KEY}={path}: {cls_name}(config, tool_schema) failed: {type(e).__name__}: {e}"
        ) from None


def _import(name: str, timeout_s: float | None):
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or spec.origin is None:
        raise ModuleNotFoundError(f"no module named {name!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        if timeout_s:
            import_within(spec, module, timeout_s, f"importing the tool module {name} hung past {timeout_s:g} s")
        else:
            spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _protocol(tool, schema: dict):
    """A call of verl's tool protocol: create, execute, release (also after a raise)."""
    props = _properties(schema)

    async def call(**kwargs: Any) -> str:
        arguments = {k: v for k, v in kwargs.items() if k in props}
        created = await tool.create(create_kwargs={k: v for k, v in kwargs.items() if k not in props})
        instance_id = created[0] if isinstance(created, tuple) else created
        try:
            result = await tool.execute(instance_id, arguments)
        finally:
            await tool.release(instance_id)
        response = result[0] if isinstance(result, tuple) else result
        text = response.get("text") if isinstance(response, dict) else getattr(response, "text", response)
        if text is not None and not isinstance(text, str):
            raise ToolError(f"{type(tool).__name__}.execute gave a {type(text).__name__}, not text")
        return text or ""

    call.__name__ = schema["function"]["name"]
    return call
