"""verl's tool configs (rollout.agent.tool_config_path, offstep/rollout/agents/verl_tools.py): verl's bundled
gsm8k and sandbox-fusion tools as offstep code, a user's BaseTool subclass driven through verl's
protocol without verl installed, bad configs refused by name, and a tiny run with a verl tool config."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest
from verl_command_lines import GSM8K_YAML

from offstep.errors import ToolConfigError
from offstep.launch.loader import load_config
from offstep.rollout.agents.agent_tools import agent_tools
from offstep.rollout.agents.tools import run_tool
from offstep.rollout.agents.verl_tools import load_verl_tools

SANDBOX_YAML = """
tools:
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config: {sandbox_fusion_url: "https://example.invalid/run_code", default_timeout: 30}
    tool_schema:
      type: function
      function:
        name: code_interpreter
        description: run a Python program
        parameters: {type: object, properties: {code: {type: string, description: the program}}, required: [code]}
"""

# A tool class written for verl: it imports verl's API, keeps per-instance state, and logs the protocol.
USER_TOOL = '''
import json
from uuid import uuid4
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

CALLS = []

class Counter(BaseTool):
    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self.step = config.get("step", 1)
        self.live = {}

    async def create(self, instance_id=None, **kwargs):
        instance_id = instance_id or str(uuid4())
        self.live[instance_id] = kwargs.get("create_kwargs", {}).get("start", 0)
        CALLS.append(("create", kwargs))
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        CALLS.append(("execute", parameters))
        if parameters.get("times") == -1:
            raise ValueError("times must be >= 0")
        value = self.live[instance_id] + self.step * parameters["times"]
        return ToolResponse(text=f"{self.name}: {value}"), 0.0, {}

    async def release(self, instance_id, **kwargs):
        CALLS.append(("release", instance_id in self.live))
        del self.live[instance_id]
'''
USER_YAML = """
tools:
  - class_name: mytools.counting.Counter
    config: {step: 3}
    tool_schema:
      type: function
      function:
        name: count
        description: count in steps
        parameters: {type: object, properties: {times: {type: integer}}, required: [times]}
"""


def _call(tool, arguments: dict, row: dict) -> tuple[str, bool]:
    r = asyncio.run(run_tool(tool, arguments, row, 10.0))
    return r.text, r.error


def test_gsm8k_tool_scores_the_answer_against_the_row(tmp_path):
    path = tmp_path / "gsm8k.yaml"
    path.write_text(GSM8K_YAML)
    [tool] = load_verl_tools(path, 10.0)
    assert tool.name == "calc_gsm8k_reward"
    assert tool.schema["function"]["parameters"]["required"] == ["answer"]  # the schema the model sees, as written
    # verl's reply text (Python's f"{answer=} {reward=}"); the flexible rule takes the last number
    assert _call(tool, {"answer": "72"}, {"ground_truth": "72"}) == ("Current parsed answer='72' reward=1.0", False)
    assert _call(tool, {"answer": "#### 1,000"}, {"ground_truth": "1000"}) == (
        "Current parsed answer='#### 1,000' reward=1.0",
        False,
    )
    assert _call(tool, {"answer": "71"}, {"ground_truth": "72"}) == ("Current parsed answer='71' reward=0.0", False)
    text, error = _call(tool, {"answer": "72"}, {})
    assert error and "ground_truth" in text


@pytest.mark.heavy
def test_sandbox_fusion_tool_runs_in_offstep_sandbox(tmp_path):
    path = tmp_path / "sandbox.yaml"
    path.write_text(SANDBOX_YAML)
    [tool] = load_verl_tools(path, 10.0)
    assert tool.name == "code_interpreter"
    assert _call(tool, {"code": "print(6 * 7)"}, {}) == ("42\n", False)
    text, error = _call(tool, {"code": "import socket; socket.create_connection(('1.1.1.1', 80), 2)"}, {})
    assert error and "Error" in text  # no network inside


def test_a_user_tool_class_runs_through_verls_protocol(tmp_path, monkeypatch):
    pkg = tmp_path / "mytools"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "counting.py").write_text(USER_TOOL)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "tools.yaml"
    path.write_text(USER_YAML)
    assert "verl" not in sys.modules or getattr(sys.modules["verl"], "__doc__", "").startswith("offstep's stand-in")
    [tool] = agent_tools(load_config([f"rollout.agent.tool_config_path={path}"]).rollout.agent)
    calls = sys.modules["mytools.counting"].CALLS
    calls.clear()
    # the row's create_kwargs reach create, the model's arguments execute; release after each call
    assert _call(tool, {"times": 2}, {"start": 10}) == ("count: 16", False)
    assert calls == [("create", {"create_kwargs": {"start": 10}}), ("execute", {"times": 2}), ("release", True)]
    calls.clear()
    text, error = _call(tool, {"times": -1}, {})
    assert error and "times must be >= 0" in text
    assert [c[0] for c in calls] == ["create", "execute", "release"]  # released although execute raised


@pytest.mark.parametrize(
    "text,match",
    [
        ("tools: []", "no list under 'tools:'"),
        ("- a\n- b", "no list under 'tools:'"),
        ("tools:\n  - config: {}\n", "needs class_name"),
        ("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n", "tool_schema must be an OpenAI function schema"),
        (
            "tools:\n  - class_name: verl.tools.search_tool.SearchTool\n    tool_schema: {function: {name: search}}\n",
            "retrieval server",
        ),
        ("tools:\n  - class_name: nowhere.at_all.Tool\n    tool_schema: {function: {name: t}}\n", "PYTHONPATH"),
        ("tools:\n  - class_name: json.JSONDecoder\n    tool_schema: {function: {name: t}}\n", "not a verl tool class"),
        ("a: &x [1]\nb: *x\n", "cannot be read"),
    ],
)
def test_bad_tool_configs_are_refused_by_name(tmp_path, text, match):
    path = tmp_path / "tools.yaml"
    path.write_text(text)
    with pytest.raises(ToolConfigError, match=match):
        load_verl_tools(path, 5.0)


def test_a_tool_config_that_is_not_a_file_is_refused_without_blocking(tmp_path):
    with pytest.raises(ToolConfigError, match="no such file"):
        load_verl_tools(tmp_path / "missing.yaml", 5.0)
    os.mkfifo(tmp_path / "fifo.yaml")
    with pytest.raises(ToolConfigError, match="cannot be read"):
        load_verl_tools(tmp_path / "fifo.yaml", 5.0)


def test_a_tool_module_that_hangs_on_import_is_refused(tmp_path, monkeypatch):
    (tmp_path / "slowtools.py").write_text("import time\ntime.sleep(60)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "tools.yaml"
    path.write_text("tools:\n  - class_name: slowtools.Tool\n    tool_schema: {function: {name: t}}\n")
    with pytest.raises(ToolConfigError, match="longer than 1 s"):
        load_verl_tools(path, 1.0)


def test_both_sources_of_tools_are_refused_and_verl_keys_translate():
    from offstep.launch.loader import ConfigError
    from offstep.launch.preflight import validate

    with pytest.raises(ConfigError, match="are both set; the tools come from one of them"):
        validate(load_config(["preset=tiny", "rollout.agent.tool_config_path=a.yaml", "rollout.agent.tools_path=b.py"]))
    notes: list[str] = []
    cfg = load_config(
        [
            "preset=tiny",
            "actor_rollout_ref.rollout.multi_turn.tool_config_path=/x/gsm8k_tool_config.yaml",
            "data.tool_config_path=/x/gsm8k_tool_config.yaml",
        ],
        notes,
    )
    assert cfg.rollout.agent.tool_config_path == "/x/gsm8k_tool_config.yaml"
    assert any(n.startswith("data.tool_config_path") for n in notes), notes


@pytest.mark.ray
def test_a_tiny_run_with_verls_gsm8k_tool_config(tmp_path, ray_session):
    """The tiny model with verl's gsm8k tool config, hermes calls, every row a tool loop: it trains
    and the schema reached the workers (the random model rarely calls it; the loop and masks run)."""
    from offstep.pipeline.controller import train
    from offstep.telemetry.metrics import read_jsonl

    path = tmp_path / "gsm8k.yaml"
    path.write_text(GSM8K_YAML)
    train(
        load_config(
            [
                "preset=tiny",
                f"trainer.output_dir={tmp_path / 'run'}",
                "trainer.total_steps=1",
                "trainer.progress=off",
                "trainer.val_before_train=false",
                "rollout.agent.default_agent=tool_agent",
                f"rollout.agent.tool_config_path={path}",
                "rollout.agent.format=hermes",
            ]
        )
    )
    [m] = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if m["step"] == 1]
    assert m["agent/turns/mean"] >= 1 and "agent/tool_calls/mean" in m  # every row ran the tool loop
