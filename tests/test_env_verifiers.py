"""verifiers environments trained unchanged (offstep.envs, docs/environments.md): a taskset written
with verifiers' own classes over a local dataset (examples/environments/vf_arith: no verifiers
example taskset runs without a hub download or a container), its episodes run by verifiers (its
chat program, interception server and rubric) against the replica's endpoint, on preset=tiny."""

from __future__ import annotations

from pathlib import Path

import pytest

from offstep.config.loader import load_config
from offstep.telemetry.metrics import read_jsonl

verifiers = pytest.importorskip("verifiers.v1")
EXAMPLES = str(Path(__file__).resolve().parent.parent / "examples" / "environments")
ENV = ["env.kind=verifiers", "env.id=vf_arith", f"env.path=[{EXAMPLES}]", "+env.args.size=8"]


def run_args(out: Path, *extra: str) -> list[str]:
    return ["preset=tiny", "trainer.total_steps=2", f"trainer.output_dir={out}", "trainer.progress=off",
            "trainer.val_before_train=false", "trainer.val_freq=0", "data.train_batch_size=2", "rollout.n=2",
            "rollout.max_new_tokens=12", "trainer.log_samples_freq=1", *ENV, *extra]


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
