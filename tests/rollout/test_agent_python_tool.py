"""The built-in python tool (offstep/rollout/agents/tools.py): a program run in the sandbox, its output
(or its failure, as text counted in agent/tool_errors) back to the model, nothing kept between
calls. No Ray."""

from __future__ import annotations

import asyncio

import pytest
from test_agent_loop import ScriptedEngine, _prompt, eos, tok  # noqa: F401 (fixtures)

from offstep.config.schema import AgentConfig
from offstep.rollout.agents.agent_loop import AgentRunner
from offstep.rollout.agents.tools import PYTHON_OUTPUT_CHARS, load_tools, run_tool
from offstep.rollout.types import SamplingParams
from offstep.sandbox import Limits, configure

pytestmark = pytest.mark.heavy  # a sandbox per call


@pytest.fixture(scope="module")
def python_tool():
    configure(Limits(timeout_s=2, output_bytes=1 << 16))
    yield load_tools(None, ["python"])[0]
    configure()


def call(tool, code: str):
    return asyncio.run(run_tool(tool, {"code": code}, {}, 20))


def test_its_schema_takes_one_program(python_tool):
    fn = python_tool.schema["function"]
    assert fn["name"] == "python" and fn["parameters"]["required"] == ["code"]


def test_output_errors_and_timeouts_come_back_as_text(python_tool):
    ok = call(python_tool, "import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)")
    assert (ok.text, ok.error) == ("42\n\nstderr:\nwarn\n", False)
    assert call(python_tool, "x = 1").text == "(no output)"
    crash = call(python_tool, "print('before')\n1 / 0")
    assert crash.error and crash.text.startswith("Error: exit status 1\nbefore\n") and "ZeroDivisionError" in crash.text
    slow = call(python_tool, "import time\ntime.sleep(30)")
    assert slow.error and slow.text.startswith("Error: killed: ran past the time limit")


def test_output_is_cut_to_the_budget(python_tool):
    r = call(python_tool, "print('x' * 50000)")
    assert not r.error and len(r.text) <= PYTHON_OUTPUT_CHARS + 20 and r.text.endswith("...(cut)")


def test_nothing_is_kept_between_calls(python_tool):
    call(python_tool, "open('/tmp/state', 'w').write('kept')\nx = 5")
    again = call(python_tool, "import os\nprint(os.path.exists('/tmp/state'), 'x' in globals())")
    assert again.text == "False False\n"


def test_the_loop_counts_a_failing_program_as_a_tool_error(tok, eos, python_tool):  # noqa: F811
    runner = AgentRunner(AgentConfig(tools=["python"], max_turns=3, tool_timeout_s=10), tok, eos)

    def script(req):
        return "done<|im_end|>" if "Error" in tok.decode(req.prompt_ids) else "<python>print(1 / 0)</python>"

    engine = ScriptedEngine(tok, eos, script)
    (res,) = runner.run(engine, [_prompt(tok)], [{}], SamplingParams(max_new_tokens=400), seed=0)
    text = tok.decode(res.response_ids)
    assert "Error: exit status 1" in text and "ZeroDivisionError" in text
    assert res.tool_errors == 1 and res.turns == 2
    runner.close()
