"""Tools of the agent loop: Python functions with OpenAI-style JSON schemas, loaded from a file by
name (as custom rewards are), run with a time limit, their failures turned into error text.

A tool is any function, sync or ``async``, whose arguments are JSON values. Its schema is the
function's ``schema`` attribute when it has one (an OpenAI tool dict, ``{"type": "function",
"function": {"name", "description", "parameters"}}``), otherwise it is read from its signature
and Google-style docstring by ``transformers.utils.get_json_schema`` (the schema that chat
templates with tool support render into the prompt).

Per-row arguments (verl's ``extra_info.tools_kwargs``: ``{tool name: {"create_kwargs": {...}}}``)
are passed as keyword arguments beside the model's; the row's win over the model's of the same
name, so a model cannot override what the data fixes (a ground truth, an instance id).

What a tool does wrong never ends the run: a raise, a non-string result or a call running past
``timeout_s`` becomes an ``Error: ...`` text for the model, and the call counts as a tool error.
A sync tool that times out keeps its thread until it returns (Python cannot stop a thread); an
async one is cancelled.

Built in: ``calculator`` (exact arithmetic, no eval) and ``python`` (a program run in
``offstep.sandbox``; stateless: each call is a fresh sandbox, see docs/sandbox.md).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

from offstep import sandbox
from offstep.config.schema import AgentConfig
from offstep.errors import ToolConfigError
from offstep.rewards.registry import CallTimeout, import_within


@dataclass(frozen=True)
class Tool:
    """One callable tool: ``fn(**arguments)``, described to the model by ``schema``."""

    name: str
    fn: Callable[..., Any]
    schema: dict

    @property
    def accepts(self) -> Callable[[str], bool]:
        """Whether the function takes a keyword argument of this name."""
        params = inspect.signature(self.fn).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return lambda name: True
        names = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        return names.__contains__


def tool_schema(fn: Callable[..., Any]) -> dict:
    """``fn.schema`` if set, else the schema transformers reads from the signature and docstring."""
    schema = getattr(fn, "schema", None)
    if schema is None:
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ToolConfigError(
                f"tool {getattr(fn, '__name__', fn)!r}: cannot read its JSON schema from the signature and docstring "
                f"({type(exc).__name__}: {exc}). Fix: give every argument a type hint and a line under 'Args:' in a "
                "Google-style docstring, or set fn.schema = {'type': 'function', 'function': {...}}"
            ) from exc
    if not isinstance(schema, dict) or not isinstance(schema.get("function"), dict) or "name" not in schema["function"]:
        raise ToolConfigError(
            f"tool {getattr(fn, '__name__', fn)!r}: schema {str(schema)[:120]} is not an OpenAI tool "
            "dict {'type': 'function', 'function': {'name': ..., 'parameters': ...}}"
        )
    return schema


def make_tool(fn: Callable[..., Any]) -> Tool:
    schema = tool_schema(fn)
    return Tool(schema["function"]["name"], fn, schema)


# The settings that messages name: offstep train's config keys; offstep eval passes its flags.
TRAIN_KEYS = {
    "path": "rollout.agent.tools_path",
    "names": "rollout.agent.tools",
    "timeout": "rollout.agent.tool_timeout_s",
}
IMPORT_TIMEOUT_S = AgentConfig.tool_timeout_s  # its default, for callers that give none


def import_file(
    path: str, timeout_s: float | None, keys: dict, what: str = "tool file", defines: str = "the tool functions"
) -> Any:
    """The module of the Python file ``path`` (imported once), within ``timeout_s`` seconds;
    :class:`ToolConfigError` names the settings ``keys['path']`` and ``keys['timeout']``."""
    path = str(Path(path).expanduser().resolve())
    if not Path(path).is_file():
        raise ToolConfigError(
            f"{what} {path} not found. Fix: set {keys['path']} to a Python file that defines {defines}"
        )
    name = f"offstep_tools_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ToolConfigError(f"{what} {path} cannot be imported as a Python module. Fix: give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    too_slow = (
        f"{keys['path']}={path} did not finish importing within {timeout_s or 0:g} s ({keys['timeout']}, the "
        "time limit of the tools' calls): its top-level code is still running (a sleep, a loop, a download, "
        f"a lock?). Fix: make importing the file only define {defines} (move slow set-up into the functions, "
        f"or under `if __name__ == \"__main__\":`), or raise {keys['timeout']}"
    )
    try:
        if timeout_s is None:
            spec.loader.exec_module(module)
        else:  # a file whose top-level code never ends must not hang the run (see import_within)
            import_within(spec, module, timeout_s, too_slow)
    except BaseException as exc:
        sys.modules.pop(name, None)
        if isinstance(exc, CallTimeout):
            raise ToolConfigError(too_slow) from None
        if not isinstance(exc, (Exception, SystemExit)):
            raise
        raise ToolConfigError(
            f"{what} {path} failed to import: {type(exc).__name__}: {exc}. Fix: make it "
            "importable on its own (run `python <file>` to see the error)"
        ) from exc
    return module


def load_tools(
    path: str | None,
    names: list[str] | tuple[str, ...],
    timeout_s: float | None = IMPORT_TIMEOUT_S,
    keys: dict = TRAIN_KEYS,
) -> list[Tool]:
    """The tools ``names``: functions of the file ``path`` (imported within ``timeout_s`` seconds,
    rollout.agent.tool_timeout_s; None: no limit), or, without a file, built-in tools
    (``BUILTIN_TOOLS``). Raises :class:`ToolConfigError` naming what is wrong, and the settings by
    the names in ``keys`` (``TRAIN_KEYS``'s)."""
    if not names:
        raise ToolConfigError(f"{keys['names']} is empty: name at least one tool (e.g. calculator)")
    module = import_file(path, timeout_s, keys) if path else None
    tools = []
    for n in names:
        fn = getattr(module, n, None) if module is not None else BUILTIN_TOOLS.get(n)
        if fn is None and module is not None:
            fn = BUILTIN_TOOLS.get(n)  # a file may be used beside the built-in calculator
        if fn is None or not callable(fn):
            where = f"in {path}" if path else f"among the built-in tools {sorted(BUILTIN_TOOLS)}"
            raise ToolConfigError(f"no tool function {n!r} {where}. Fix: define it there, or correct {keys['names']}")
        tools.append(make_tool(fn))
    dup = sorted({t.name for t in tools if [u.name for u in tools].count(t.name) > 1})
    if dup:
        raise ToolConfigError(f"tools {dup} are named twice in {keys['names']}")
    return tools


# --------------------------------------------------------------------------------------------------
# running a call


@dataclass
class ToolResult:
    text: str  # what the model reads
    error: bool = False
    seconds: float = 0.0


class ToolError(Exception):
    """A tool's failure told to the model as its message alone (``Error: <message>``)."""


def _error(exc_or_text: BaseException | str) -> str:
    if isinstance(exc_or_text, (str, ToolError)):
        return f"Error: {exc_or_text}"
    msg = str(exc_or_text)
    return f"Error: {type(exc_or_text).__name__}" + (f": {msg}" if msg else "")


async def run_tool(tool: Tool, arguments: dict, row_kwargs: dict, timeout_s: float | None, executor=None) -> ToolResult:
    """Call ``tool`` with the model's ``arguments`` and the row's ``row_kwargs`` (those the function
    accepts; they win over the model's); never raises (except for cancellation)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    accepts = tool.accepts
    kwargs = {**arguments, **{k: v for k, v in row_kwargs.items() if accepts(k)}}
    try:
        inspect.signature(tool.fn).bind(**kwargs)
    except TypeError as exc:
        return ToolResult(_error(f"bad arguments for {tool.name}: {exc}"), True, loop.time() - t0)
    try:
        if inspect.iscoroutinefunction(tool.fn):
            call = tool.fn(**kwargs)
        else:
            call = loop.run_in_executor(executor, functools.partial(tool.fn, **kwargs))
        result = await asyncio.wait_for(call, timeout_s) if timeout_s else await call
    except asyncio.TimeoutError:
        return ToolResult(
            _error(f"{tool.name} took longer than {timeout_s:g} s and was stopped"), True, loop.time() - t0
        )
    except Exception as exc:  # noqa: BLE001 - the model reads the error; the run goes on
        return ToolResult(_error(exc), True, loop.time() - t0)
    if not isinstance(result, str):
        return ToolResult(
            _error(f"{tool.name} returned a {type(result).__name__}, not a string"), True, loop.time() - t0
        )
    return ToolResult(result, False, loop.time() - t0)


# --------------------------------------------------------------------------------------------------
# the built-in calculator: a recursive-descent parser over exact rationals (no eval)


class CalcError(ValueError):
    pass


_MAX_DIGITS = 60  # largest result, in digits: beyond it a power (or a product) is refused
_MAX_DEPTH = 50  # nesting of parentheses / unary signs
_MAX_CHARS = 200


class _Parser:
    """expr := term (('+'|'-') term)* ; term := power (('*'|'/'|'%') power)* ;
    power := unary ('^'|'**' power)? ; unary := ('-'|'+') unary | atom ; atom := number | '(' expr ')'"""

    def __init__(self, text: str):
        self.s, self.i, self.depth = text, 0, 0

    def parse(self) -> Fraction:
        value = self.expr()
        self.skip()
        if self.i != len(self.s):
            raise CalcError(f"unexpected {self.s[self.i]!r} at position {self.i}")
        return value

    def skip(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def peek(self, *ops: str) -> str | None:
        self.skip()
        return next((op for op in ops if self.s.startswith(op, self.i)), None)

    def expr(self) -> Fraction:
        value = self.term()
        while (op := self.peek("+", "-")) is not None:
            self.i += 1
            rhs = self.term()
            value = value + rhs if op == "+" else value - rhs
            _check_size(value)
        return value

    def term(self) -> Fraction:
        value = self.power()
        while (op := self.peek("**", "*", "/", "%", "x", "×", "÷")) is not None:
            if op == "**":  # a power, handled one level down
                break
            self.i += len(op)
            rhs = self.power()
            if op in ("*", "x", "×"):
                value = value * rhs
            elif rhs == 0:
                raise CalcError("division by zero")
            elif op in ("/", "÷"):
                value = value / rhs
            else:
                value = value - rhs * math.floor(value / rhs)
            _check_size(value)
        return value

    def power(self) -> Fraction:
        base = self.unary()
        op = self.peek("**", "^")
        if op is None:
            return base
        self.i += len(op)
        exp = self.power()  # right-associative
        if exp.denominator != 1:
            raise CalcError("only whole-number exponents are supported")
        if base == 0 and exp < 0:
            raise CalcError("division by zero")
        widest = max(abs(base.numerator), base.denominator, 2)
        if abs(exp.numerator) * math.log10(widest) > _MAX_DIGITS:
            raise CalcError(f"the result would have more than {_MAX_DIGITS} digits")
        return base**exp.numerator

    def unary(self) -> Fraction:
        op = self.peek("-", "+")
        if op is None:
            return self.atom()
        self.i += 1
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise CalcError("too deeply nested")
        value = self.unary()
        self.depth -= 1
        return -value if op == "-" else value

    def atom(self) -> Fraction:
        self.skip()
        if self.peek("("):
            self.i += 1
            self.depth += 1
            if self.depth > _MAX_DEPTH:
                raise CalcError("too deeply nested")
            value = self.expr()
            if not self.peek(")"):
                raise CalcError("missing ')'")
            self.i += 1
            self.depth -= 1
            return value
        start = self.i
        while self.i < len(self.s) and (self.s[self.i].isdigit() or self.s[self.i] in "._,"):
            self.i += 1
        token = self.s[start : self.i].replace(",", "").replace("_", "")
        if not token or token == "." or token.count(".") > 1 or not token.replace(".", "").isascii():
            what = repr(self.s[start]) if start < len(self.s) else "the end"
            raise CalcError(f"expected a number at position {start}, found {what}")
        return Fraction(token)


def _check_size(value: Fraction) -> None:
    if len(str(abs(value.numerator))) > _MAX_DIGITS or len(str(value.denominator)) > _MAX_DIGITS:
        raise CalcError(f"the result has more than {_MAX_DIGITS} digits")


def format_number(value: Fraction) -> str:
    """An integer as itself; otherwise a decimal with up to 10 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: numbers, + - * / % and ^ or ** (whole
    exponents), parentheses, unary signs. Raises :class:`CalcError` for anything else."""
    if not isinstance(expression, str):
        raise CalcError(f"the expression must be a string, got {type(expression).__name__}")
    if len(expression) > _MAX_CHARS:
        raise CalcError(f"the expression is longer than {_MAX_CHARS} characters")
    text = expression.strip().rstrip("=").strip()
    if not text:
        raise CalcError("empty expression")
    return _Parser(text).parse()


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: the arithmetic to evaluate, with numbers, + - * / %, ^ for powers and parentheses, e.g. "(12 + 3) * 47"
    """
    return format_number(evaluate(expression))


# --------------------------------------------------------------------------------------------------
# the built-in python tool

PYTHON_OUTPUT_CHARS = 2000  # what one call returns at most (the agent loop then cuts to max_tool_response_chars)


def _cut(text: str, budget: int, keep_end: bool = False) -> str:
    if len(text) <= budget:
        return text
    return "...(cut)\n" + text[-budget:] if keep_end else text[:budget] + "\n...(cut)"


def python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed. Each call starts afresh: no variables or files are kept between calls, and there is no network.

    Args:
        code: the whole program; print() what you want to see
    """
    r = sandbox.shared().run(code)
    out = _cut(r.stdout, PYTHON_OUTPUT_CHARS // 2)
    err = _cut(r.stderr, PYTHON_OUTPUT_CHARS - len(out), keep_end=True)  # a traceback's last lines say most
    if not r.ok:
        raise ToolError("\n".join(x for x in (r.describe(), out, err) if x))
    return out + (f"\nstderr:\n{err}" if err else "") if (out or err) else "(no output)"


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator, "python": python}
