"""Tool rows through the whole pipeline (Ray): k = 0, 1, 2, validation, both engines; and the
calculator preset's first steps on the real SmolLM2 (slow)."""

from __future__ import annotations

import pytest
from conftest import FAST_ONE_STEP, needs_vllm
from reference_loop import assert_matches_in_process_reference

from offstep.launch.loader import load_config
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl

pytestmark = pytest.mark.ray  # every test here starts Ray

AGENT_METRICS = [
    "agent/turns/mean",
    "agent/turns/max",
    "agent/tool_calls/mean",
    "agent/tool_errors",
    "agent/tool_time_s",
    "agent/budget_cut_frac",
    "agent/masked_token_frac",
    "agent/well_formed_calls/frac",
]


def _run(out, k: int, steps: int, *extra: str):
    cfg = load_config(
        [
            "preset=tiny",
            f"pipeline.max_staleness={k}",
            f"trainer.total_steps={steps}",
            f"trainer.output_dir={out}",
            "trainer.progress=off",
            "data.task_val_size=8",
            "rollout.agent.default_agent=tool_agent",
            *extra,
        ]
    )
    train(cfg)
    metrics = read_jsonl(out / "metrics.jsonl")
    return cfg, [m for m in metrics if m["step"] >= 1], metrics, read_jsonl(out / "timeline.jsonl")


@pytest.mark.parametrize(
    "k,engine",
    [(0, "builtin"), (1, "builtin"), (2, "builtin"), pytest.param(1, "vllm", marks=[needs_vllm, pytest.mark.slow])],
    ids=["sync", "one-step", "two-step", "one-step-vllm"],
)
def test_tool_rows_train_at_every_staleness(tmp_path, ray_session, k, engine):
    """Every row a tool row (the tiny random model rarely writes a call, so most loops end after
    one turn: the pipeline's bookkeeping, not the tools, is under test here; the loop itself is
    tests/rollout/test_agent_loop.py's): agent/ metrics every step and in validation, the staleness
    pattern of k, the versions per batch; and k = 0 equals the synchronous loop run in one process
    over the same parts (tool loops included), step for step."""
    steps = 3 if k < 2 else 4
    cfg, metrics, everything, timeline = _run(tmp_path, k, steps, f"rollout.engine={engine}")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        missing = [key for key in AGENT_METRICS if key not in m]
        assert not missing, missing
        assert m["agent/turns/mean"] >= 1 and m["actor/grad_norm"] > 0
    assert [m["rollout/staleness_max"] for m in metrics] == {0: [0, 0, 0], 1: [0, 1, 1], 2: [0, 1, 2, 2]}[k]
    gen = [e["version"] for e in timeline if e["stage"] == "gen"]
    assert gen == {0: [0, 1, 2], 1: [0, 0, 1], 2: [0, 0, 0, 1]}[k]
    assert (
        everything[0]["step"] == 0
        and "val/agent/turns/mean" in everything[0]
        and "val/agent/turns/mean" in everything[-1]
    )
    if k == 0 and engine == "builtin":
        assert_matches_in_process_reference(cfg, metrics, tmp_path / "ref")


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["builtin", pytest.param("vllm", marks=needs_vllm)])
def test_calculator_preset_calls_the_tool(tmp_path, ray_session, engine):
    """preset=calculator on SmolLM2-135M, one step of a few prompts: the model calls the
    calculator, the tool turns are masked, tool time is on the rollout lane."""
    train(
        load_config(
            [
                "preset=calculator",
                f"rollout.engine={engine}",
                "trainer.total_steps=1",
                f"trainer.output_dir={tmp_path}",
                "trainer.progress=off",
                "trainer.val_before_train=false",
                "data.train_batch_size=4",
                "data.task_val_size=4",
                "trainer.log_samples_freq=1",
                "trainer.log_samples_count=8",
                *FAST_ONE_STEP,
            ]
        )
    )
    m = read_jsonl(tmp_path / "metrics.jsonl")[0]
    assert m["agent/tool_calls/mean"] > 0 and m["agent/turns/max"] >= 2, m
    assert 0 < m["agent/masked_token_frac"] < 1
    timeline = read_jsonl(tmp_path / "timeline.jsonl")
    assert any(e["stage"] == "tool" and e["role"] == "rollout/0" for e in timeline)
    assert all("turns" in r and "tool_calls" in r for r in read_jsonl(tmp_path / "samples.jsonl"))
