"""Tool-call formats: how the agent loop finds the calls in a model turn (``rollout.agent.format``).

``hermes``
    ``<tool_call>{"name": "calculator", "arguments": {"expression": "47*86"}}</tool_call>``, the
    format of Qwen2.5's and many other chat templates (NousResearch's Hermes function calling).
    Several calls in one turn are allowed; ``arguments`` may be an object or a JSON string.
``tag``
    ``<calculator>47*86</calculator>``: the tool's name as an XML-like tag around its argument,
    for models whose chat template has no tool support (SmolLM2). The text between the tags is
    the tool's one required argument, or, when it starts with ``{``, a JSON object of arguments.

A turn *attempts* a call when it contains the format's opening marker; an attempt that does not
parse (bad JSON, no closing tag, an unknown tool, arguments that are not an object) is returned
as a :class:`ToolCall` with ``error`` set, and the model reads that error as the tool's answer.
Generation of a turn stops at a closing marker (``stop_strings``), so the model never writes the
tool's answer itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from offstep.config.choices import TOOL_FORMATS as FORMATS


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # set when the call is malformed; the model reads it

    @property
    def well_formed(self) -> bool:
        return self.error is None


def _first_required(schema: dict) -> str | None:
    params = schema.get("function", {}).get("parameters", {}) or {}
    required = params.get("required") or list((params.get("properties") or {}).keys())
    return required[0] if required else None


class HermesParser:
    open, close = "<tool_call>", "</tool_call>"
    _pattern = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)

    def __init__(self, schemas: dict[str, dict]):
        self.schemas = schemas

    def stop_strings(self) -> tuple[str, ...]:
        return (self.close,)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for m in self._pattern.finditer(text):
            body = m.group(1).strip()
            if not m.group(0).endswith(self.close):
                calls.append(ToolCall("", error=f"the tool call has no closing {self.close}"))
                continue
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as exc:
                calls.append(ToolCall("", error=f"the tool call is not valid JSON ({exc.msg})"))
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                calls.append(ToolCall("", error='a tool call needs {"name": ..., "arguments": {...}}'))
                continue
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
            calls.append(_checked(obj["name"], args, self.schemas))
        return calls


class TagParser:
    def __init__(self, schemas: dict[str, dict]):
        self.schemas = schemas
        names = "|".join(re.escape(n) for n in sorted(schemas, key=len, reverse=True))
        self._pattern = re.compile(rf"<({names})>(.*?)(</\1>|$)", re.S)

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(f"</{n}>" for n in self.schemas)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for m in self._pattern.finditer(text):
            name, body, closed = m.group(1), m.group(2).strip(), m.group(3)
            if not closed:
                calls.append(ToolCall(name, error=f"the tool call has no closing </{name}>"))
                continue
            if body.startswith("{"):
                try:
                    args = json.loads(body)
                except json.JSONDecodeError as exc:
                    calls.append(ToolCall(name, error=f"the arguments are not valid JSON ({exc.msg})"))
                    continue
            else:
                key = _first_required(self.schemas[name])
                args = {key: body} if key else {}
            calls.append(_checked(name, args, self.schemas))
        return calls


def _checked(name: str, args, schemas: dict[str, dict]) -> ToolCall:
    if name not in schemas:
        return ToolCall(name, error=f"there is no tool {name!r}; the tools are {sorted(schemas)}")
    if not isinstance(args, dict):
        return ToolCall(name, error=f"the arguments of {name} must be a JSON object, got {type(args).__name__}")
    return ToolCall(name, args)


def make_parser(fmt: str, schemas: dict[str, dict]):
    """The parser of format ``fmt`` for tools with these schemas (name -> OpenAI schema)."""
    if fmt == "hermes":
        return HermesParser(schemas)
    if fmt == "tag":
        return TagParser(schemas)
    raise ValueError(f"rollout.agent.format={fmt!r} is not one of {FORMATS}")
