"""verifiers environments trained unchanged (offstep.envs, docs/environments.md): a taskset written
with verifiers' own classes over a local dataset (examples/environments/vf_arith: no verifiers
example taskset runs without a hub download or a container), its episodes run by verifiers (its
chat program, interception server and rubric) against the replica's endpoint, on preset=tiny."""

from __future__ import annotations

from pathlib import Path

import pytest

from offstep.launch.loader import load_config
from offstep.telemetry.metrics import read_jsonl

verifiers = pytest.importorskip("verifiers.v1")
EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples" / "environments")
ENV = ["env.kind=verifiers", "env.id=vf_arith", f"env.path=[{EXAMPLES}]", "+env.args.size=8"]


def run_args(out: Path, *extra: str) -> list[str]:
    return [
        "preset=tiny",
        "trainer.total_steps=2",
        f"trainer.output_dir={out}",
        "trainer.progress=off",
        "trainer.val_before_train=false",
        "trainer.val_freq=0",
        "data.train_batch_size=2",
        "rollout.n=2",
        "rollout.max_new_tokens=12",
        "trainer.log_samples_freq=1",
        *ENV,
        *extra,
    ]


def test_load_failure_is_refused_before_ray(tmp_path):
    from offstep.envs.rows import EnvLoadError, rollouts

    cfg = load_config(run_args(tmp_path, "env.id=no_such_taskset"))
    with pytest.raises(EnvLoadError, match="no_such_taskset"):
        rollouts(cfg.env)


@pytest.mark.ray
@pytest.mark.slow
def test_verifiers_env_trains(tmp_path, ray_session):
    from offstep.pipeline.controller import train

    out = tmp_path / "run"
    train(load_config(run_args(out, "pipeline.max_staleness=1")))
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        # the rubric's weighted parts, and their sum the reward
        assert {"reward/correct", "reward/brief"} <= m.keys(), m
        assert abs(m["reward/correct"] + m["reward/brief"] - m["reward/mean"]) < 1e-6
        assert m["env/errors"] == 0 and m["env/timeouts"] == 0
        assert m["agent/prefix_breaks"] == 0 and m["actor/grad_norm"] > 0


@pytest.mark.ray
@pytest.mark.slow
def test_verifiers_env_trains_fully_async(tmp_path, ray_session):
    """pipeline.mode=fully_async: the stream runs the episodes (its OpenAI runner for env rows)."""
    from offstep.pipeline.controller import train

    out = tmp_path / "run"
    train(load_config(run_args(out, "pipeline.mode=fully_async", "pipeline.max_staleness=1")))
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert abs(m["reward/correct"] + m["reward/brief"] - m["reward/mean"]) < 1e-6
        assert m["env/errors"] == 0 and m["agent/prefix_breaks"] == 0


@pytest.mark.ray
@pytest.mark.slow
def test_failing_env_is_counted_and_retried(tmp_path, ray_session):
    """Every third episode's scoring raises: the run goes on, each failure counted in env/errors and
    its rollout run again in a fresh session (env.on_error=retry), none trained as reward 0."""
    from offstep.pipeline.controller import train

    out = tmp_path / "run"
    train(load_config(run_args(out, "pipeline.max_staleness=1", "+env.args.fail_every=3", "env.retries=3")))
    metrics = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2]
    assert sum(m["env/errors"] for m in metrics) >= 1 and all(m["env/timeouts"] == 0 for m in metrics)
    for m in metrics:  # the trained rewards are the rubric's, parts and all
        assert abs(m["reward/correct"] + m["reward/brief"] - m["reward/mean"]) < 1e-6


@pytest.mark.heavy
def test_trajectories_are_the_endpoints_tokens(tmp_path):
    """Without Ray: a verifiers environment's rollouts through the replica's endpoint on the tiny
    model; each sample is, token for token, what the engine sampled for its calls (the tokens and
    their log-probs, masked 1) after the prompt the endpoint rendered, and its reward verifiers'."""
    import torch

    from offstep.envs.rows import env_agent
    from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer, resolve_model
    from offstep.rollout.agents.openai_agent import OpenAIRunner
    from offstep.rollout.engines.torch_engine import TorchEngine
    from offstep.rollout.replica_spec import Request
    from offstep.rollout.types import SamplingParams

    cfg = load_config(run_args(tmp_path))
    path = resolve_model("tiny")
    tok = load_tokenizer(path)
    eos = eos_token_ids(tok, path)
    engine = TorchEngine(load_causal_lm(path, torch.float32), tok, eos)
    calls = []  # (prompt, completion) of every generation the endpoint asked for
    generate = engine.generate

    def spy(prompts, params, seed, on_finish=None):
        out = generate(prompts, params, seed, on_finish)
        calls.extend((prompts[c.prompt_index], c) for c in out)
        return out

    engine.generate = spy
    runner = OpenAIRunner(env_agent(cfg.rollout.agent, cfg.env), tok, eos)
    rows = [
        Request(
            uid=i,
            prompt_ids=[],
            data_source="verifiers:vf_arith",
            ground_truth=None,
            extra_info={"env_task": i, "index": i},
            agent_name="openai",
            messages=m,
        )
        for i, m in enumerate(runner.fn.prompts()[:2])
    ]
    samples = runner.run(engine, rows, SamplingParams(n=2, max_new_tokens=12, temperature=1.0), seed=3)
    assert len(samples) == 4 and len(calls) == 4  # one call per single-turn episode
    for s in samples:
        sampled = [(p, c) for p, c in calls if p == s.prompt_ids and c.response_ids == s.response_ids]
        assert len(sampled) >= 1, "a sample is not one of the endpoint's generations"
        c = sampled[0][1]
        assert s.rollout_logprobs == c.logprobs and s.loss_mask == [1] * len(c.response_ids)
        assert s.reward_extra["env/errors"] == 0 and set(s.reward_extra) >= {"reward/correct", "reward/brief"}
        assert abs(s.score - s.reward_extra["reward/correct"] - s.reward_extra["reward/brief"]) < 1e-9


@pytest.mark.ray
@pytest.mark.slow
def test_a_kill_resumes_and_trains_every_group_once(tmp_path, ray_session):
    """SIGKILL after the step-2 checkpoint (k = 1: it holds the batch generating then, its episodes
    in verifiers' chat programs); the resumed run trains steps 3 and 4, each batch's prompts once."""
    import os
    import signal
    import time

    from cli_runs import cli, wait_for

    from offstep.pipeline.controller import train

    run = tmp_path / "run"
    args = run_args(run, "trainer.total_steps=4", "trainer.save_freq=2", "pipeline.max_staleness=1")
    proc = cli(args)
    wait_for(run / "checkpoints" / "step_000002" / "trainer_state.json", proc, timeout=900)
    time.sleep(1.0)  # into step 3, its batch's episodes in flight
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = [m["step"] for m in read_jsonl(run / "metrics.jsonl")]
    assert before and max(before) < 4, "the run was meant to be killed before it finished"

    history = train(load_config(args))  # trainer.resume=auto
    assert [m["step"] for m in history] == [3, 4]
    metrics = [m for m in read_jsonl(run / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # none lost, none repeated
    crcs = [m["data/prompts_crc32"] for m in metrics]
    assert len(set(crcs)) == 4, crcs  # each batch's prompts trained once
    assert all(m["env/errors"] == 0 and m["agent/prefix_breaks"] == 0 for m in metrics)
