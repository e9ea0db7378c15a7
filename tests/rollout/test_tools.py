"""Tools for multi-turn rollouts (offstep.rollout.agents.tools, tool_parsers): the calculator, tools loaded
from a user's file, tool failures as error text, the call formats, and the docs' example tool file.
No model, no Ray."""

from __future__ import annotations

import asyncio
import time

import pytest

from offstep.rollout.agents.tool_parsers import make_parser
from offstep.rollout.agents.tools import CalcError, ToolConfigError, calculator, evaluate, load_tools, run_tool

# ------------------------------------------------------------------ the calculator


@pytest.mark.parametrize(
    "expr,want",
    [
        ("47 * 86", "4042"),
        ("(12 + 3) * 47", "705"),
        ("2 + 3 * 4", "14"),
        ("2^10", "1024"),
        ("2 ** 3 ** 2", "512"),
        ("7 / 2", "3.5"),
        ("-3 * -2", "6"),
        ("10 % 3", "1"),
        ("1,234 * 2", "2468"),
        ("45*67=", "3015"),
        ("1/3", "0.3333333333"),
    ],
)
def test_calculator_values(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize(
    "expr", ["", "abc", "3 +", "((1)", "1/0", "2^1000", "2 ^ 0.5", "__import__('os')", "9" * 300, "-" * 100 + "1"]
)
def test_calculator_refuses_what_it_cannot_compute(expr):
    with pytest.raises(CalcError):
        evaluate(expr)


def test_calculator_schema_comes_from_its_docstring():
    (tool,) = load_tools(None, ["calculator"])
    fn = tool.schema["function"]
    assert fn["name"] == "calculator" and fn["parameters"]["required"] == ["expression"]


# ------------------------------------------------------------------ loading and running tools

TOOL_FILE = '''
import asyncio, time

def lookup(key: str, table: dict = None) -> str:
    """Look a key up.

    Args:
        key: what to look up
        table: the row's table (from tools_kwargs)
    """
    return str((table or {}).get(key, "missing"))

async def slow_async(x: str) -> str:
    """Sleep.

    Args:
        x: anything
    """
    await asyncio.sleep(5)
    return x

def slow_sync(x: str) -> str:
    """Sleep.

    Args:
        x: anything
    """
    time.sleep(1)
    return x

def boom(x: str) -> str:
    """Raise.

    Args:
        x: anything
    """
    raise RuntimeError("kaput")

def number(x: str) -> str:
    """Return a number, not a string.

    Args:
        x: anything
    """
    return 42

number.schema = {"type": "function", "function": {"name": "number", "description": "n",
                 "parameters": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}
'''


@pytest.fixture(scope="module")
def tool_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tools") / "my_tools.py"
    path.write_text(TOOL_FILE)
    return str(path)


def test_load_tools_from_a_file_and_builtins(tool_file):
    tools = load_tools(tool_file, ["lookup", "number", "calculator"])
    assert [t.name for t in tools] == ["lookup", "number", "calculator"]
    assert tools[1].schema["function"]["description"] == "n"  # fn.schema wins over the docstring
    with pytest.raises(ToolConfigError, match="no tool function 'nope'"):
        load_tools(tool_file, ["nope"])
    with pytest.raises(ToolConfigError, match="not found"):
        load_tools("/no/such/file.py", ["x"])


def _run(coro):
    return asyncio.run(coro)


def test_tool_failures_become_error_text(tool_file):
    tools = {t.name: t for t in load_tools(tool_file, ["lookup", "slow_async", "slow_sync", "boom", "number"])}
    ok = _run(run_tool(tools["lookup"], {"key": "a"}, {"table": {"a": "1"}}, 5.0))
    assert (ok.text, ok.error) == ("1", False)
    # The row's arguments win over the model's of the same name.
    assert (
        _run(run_tool(tools["lookup"], {"key": "a", "table": {"a": "forged"}}, {"table": {"a": "1"}}, 5.0)).text == "1"
    )
    raised = _run(run_tool(tools["boom"], {"x": "1"}, {}, 5.0))
    assert raised.error and raised.text == "Error: RuntimeError: kaput"
    wrong_type = _run(run_tool(tools["number"], {"x": "1"}, {}, 5.0))
    assert wrong_type.error and "returned a int, not a string" in wrong_type.text
    t0 = time.time()
    timed_out = _run(run_tool(tools["slow_async"], {"x": "1"}, {}, 0.2))
    assert timed_out.error and "longer than 0.2 s" in timed_out.text and time.time() - t0 < 2
    sync_timeout = _run(run_tool(tools["slow_sync"], {"x": "1"}, {}, 0.2))
    assert sync_timeout.error and "longer than 0.2 s" in sync_timeout.text
    bad_args = _run(run_tool(tools["lookup"], {"nope": 1}, {}, 5.0))
    assert bad_args.error and "bad arguments for lookup" in bad_args.text


# ------------------------------------------------------------------ call formats

SCHEMAS = {t.name: t.schema for t in load_tools(None, ["calculator"])}


def test_tag_format():
    p = make_parser("tag", SCHEMAS)
    assert p.stop_strings() == ("</calculator>",)
    (call,) = p.parse("Let me compute. <calculator> 47 * 86 </calculator>")
    assert call.well_formed and call.name == "calculator" and call.arguments == {"expression": "47 * 86"}
    (json_args,) = p.parse('<calculator>{"expression": "1+1"}</calculator>')
    assert json_args.arguments == {"expression": "1+1"}
    (unclosed,) = p.parse("<calculator>47 * 86")
    assert not unclosed.well_formed and "no closing" in unclosed.error
    assert p.parse("The answer is 4042.") == []


def test_hermes_format():
    p = make_parser("hermes", SCHEMAS)
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call>'
    )
    a, b = p.parse(text)
    assert a.arguments == {"expression": "2*3"} and b.arguments == {"expression": "4"}
    bad_json, unknown, no_args = p.parse(
        '<tool_call>{"name": </tool_call><tool_call>{"name": "search", "arguments": {}}'
        '</tool_call><tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
    )
    assert "not valid JSON" in bad_json.error and "no tool 'search'" in unknown.error and "JSON object" in no_args.error


def test_the_example_tool_file_works():
    """examples/tools/shop_tools.py, the complete example of docs/tools-and-agents.md: an async tool with a per-row
    argument, a sync one whose error reaches the model, a hand-written schema."""
    from pathlib import Path

    example = str(Path(__file__).resolve().parents[2] / "examples" / "tools" / "shop_tools.py")
    price, convert = load_tools(example, ["price", "convert"])
    assert price.schema["function"]["parameters"]["required"] == ["item"]
    assert _run(run_tool(price, {"item": "Mug"}, {"catalogue": {"mug": 12}}, 5.0)).text == "12 EUR"
    assert _run(run_tool(convert, {"amount": 10, "currency": "usd"}, {}, 5.0)).text == "10.80 USD"
    assert "unknown currency" in _run(run_tool(convert, {"amount": 1, "currency": "XYZ"}, {}, 5.0)).text
    from offstep.rewards.registry import load_custom_scorer

    score = load_custom_scorer(example)
    answered = {"final_text": "It costs 12 EUR.", "ended_by": "answer", "tool_calls": []}
    assert score("shop", "", "12 EUR", extra_info=answered)["score"] == 1.0
    assert score("shop", "", "12 EUR", extra_info={**answered, "ended_by": "budget"})["score"] == 0.0
