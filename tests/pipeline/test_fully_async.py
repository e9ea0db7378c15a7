"""The fully asynchronous mode (``pipeline.mode=fully_async``) through Ray on the tiny preset: k = 0
is the synchronous loop step for step; k >= 1 logs the stream's metrics and keeps the bound; a
checkpoint stores the stream's groups and a resume trains each of them once; the combinations the
mode does not run are refused before start."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import needs_vllm
from reference_loop import assert_matches_in_process_reference

from offstep.launch.loader import load_config
from offstep.launch.validate import problems
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl

STREAM_METRICS = [
    "rollout/staleness_max",
    "rollout/staleness_mean",
    "rollout/version_span_max",
    "rollout/partial_samples",
    "rollout/queue_depth",
    "rollout/dropped_stale",
    "rollout/length_bias",
]


def _cfg(out, k: int, steps: int, *extra: str):
    return load_config(
        [
            "preset=tiny",
            "pipeline.mode=fully_async",
            f"pipeline.max_staleness={k}",
            f"trainer.total_steps={steps}",
            f"trainer.output_dir={out}",
            "trainer.progress=off",
            *extra,
        ]
    )


def _steps(out) -> list[dict]:
    return [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]


@pytest.mark.ray
def test_staleness_zero_equals_the_synchronous_loop(tmp_path, ray_session):
    """k = 0: every step trains the batch mode's batch, generated with its seeds by the policy of
    the step before, and its losses equal an in-process synchronous loop's (verl issue 6780)."""
    cfg = _cfg(tmp_path / "run", 0, 3, "trainer.val_before_train=false")
    train(cfg)
    metrics = _steps(tmp_path / "run")
    assert [m["rollout/partial_samples"] for m in metrics] == [0, 0, 0]
    assert_matches_in_process_reference(cfg, metrics, tmp_path / "ref")


@pytest.mark.ray
@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_one_step_stream_logs_its_metrics_and_keeps_the_bound(tmp_path, ray_session, transport):
    """k = 1 on either weight path. The collective one receives beside the running stream into
    buffers of the replica's own and applies them between two decode steps: every sync's digest
    matches what the actor sent."""
    out = tmp_path / "run"
    train(
        _cfg(
            out,
            1,
            5,
            "trainer.val_before_train=false",
            "rollout.max_new_tokens=24",
            f"pipeline.weight_sync={transport}",
        )
    )
    metrics = _steps(out)
    assert all(m["sync/verified"] == 1.0 and m["sync/collective"] == float(transport == "collective") for m in metrics)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert [m["policy_version"] for m in metrics] == [1, 2, 3, 4, 5]
    for m in metrics:
        assert all(k in m for k in STREAM_METRICS), [k for k in STREAM_METRICS if k not in m]
        assert 0 <= m["rollout/staleness_max"] <= 1 and m["rollout/dropped_stale"] == 0
        assert 1 <= m["rollout/version_span_max"] <= 2
        assert m["rollout/partial_samples"] <= 8  # the batch's 4 groups x 2 samples
    assert metrics[0]["rollout/staleness_max"] == 0
    timeline = read_jsonl(out / "timeline.jsonl")
    assert {e["step"] for e in timeline if e["stage"] == "gen"} == {1, 2, 3, 4, 5}
    assert len([e for e in timeline if e["stage"] == "load_weights"]) == 5


@pytest.mark.ray
def test_a_rollout_worker_that_dies_in_the_stream_is_replaced(tmp_path, ray_session):
    """The replica's process exits while scoring a finished sample (the scorer is the user's code):
    a new replica is started with the current weights, the dead one's groups are generated again,
    and the run trains every step, within the bound."""
    from cli_runs import DYING_REWARD

    reward = tmp_path / "dying.py"
    reward.write_text(DYING_REWARD.replace("MARKER", repr(str(tmp_path / "died"))))
    out = tmp_path / "run"
    train(_cfg(out, 1, 3, "trainer.val_before_train=false", f"reward.custom_path={reward}", "rollout.max_restarts=1"))
    assert (tmp_path / "died").exists(), "the worker was meant to die once"
    metrics = _steps(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(0 <= m["rollout/staleness_max"] <= 1 for m in metrics)


@pytest.mark.ray
def test_a_resume_trains_every_stored_group_once(tmp_path, ray_session):
    """k = 2, a checkpoint at step 2 holds the groups admitted beyond it (finished or partial);
    resumed from it, steps 3 and 4 train exactly those: none lost, none generated again, no
    prompt used twice (admission is capped at total_steps x train_batch_size)."""
    run, again = tmp_path / "run", tmp_path / "again"
    cfg = _cfg(run, 2, 4, "trainer.val_before_train=false", "trainer.save_freq=2", "rollout.max_new_tokens=24")
    train(cfg)
    shutil.copytree(run, again)
    shutil.rmtree(again / "checkpoints" / "step_000004")
    state = json.loads((again / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
    stored = state["stream_groups"]
    B = cfg.data.train_batch_size
    # every group admitted (the bound at version 1 allows all 4 batches) and not yet trained: which
    # 2B of the 4B were trained first depends on which finished first (earliest deadline, then any)
    kept = [g["g"] for g in stored["groups"]]
    assert stored["admitted"] == 4 * B and len(set(kept)) == len(kept) == 2 * B and set(kept) <= set(range(4 * B)), kept
    for g in stored["groups"]:
        states = g["states"] or []
        assert all(len(s["tokens"]) == len(s["logprobs"]) == len(s["versions"]) for s in states)
    history = train(
        _cfg(again, 2, 4, "trainer.val_before_train=false", "trainer.save_freq=2", "rollout.max_new_tokens=24")
    )
    assert [m["step"] for m in history] == [3, 4]
    final = json.loads((again / "checkpoints" / "step_000004" / "trainer_state.json").read_text())["stream_groups"]
    assert final["admitted"] == 4 * B and final["groups"] == [], "every stored group trained, none admitted anew"


@pytest.mark.ray
@needs_vllm
def test_vllm_replicas_stream_with_partial_rollouts(tmp_path, ray_session):
    """rollout.engine=vllm: the replica's vLLM engine takes each load between two decode steps
    (rollout.partial=recompute: its preemption path) and tags every token with its version."""
    out = tmp_path / "run"
    train(
        _cfg(
            out,
            1,
            3,
            "trainer.val_before_train=false",
            "rollout.engine=vllm",
            "rollout.partial=recompute",
            "rollout.max_new_tokens=24",
        )
    )
    metrics = _steps(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert all(k in m for k in STREAM_METRICS), [k for k in STREAM_METRICS if k not in m]
        assert 0 <= m["rollout/staleness_max"] <= 1 and m["rollout/dropped_stale"] == 0
        assert 1 <= m["rollout/version_span_max"] <= 2
    timeline = read_jsonl(out / "timeline.jsonl")
    assert len([e for e in timeline if e["stage"] == "load_weights"]) == 3


@pytest.mark.parametrize(
    "override,needle",
    [
        ("rollout.engine=vllm actor.lora.rank=8", "rollout.engine=builtin, or pipeline.mode=batch for LoRA on vLLM"),
        ("algorithm.dynamic_sampling=true", "pipeline.mode=batch"),
        ("rollout.partial=sometimes", "rollout.partial='sometimes' is not one of"),
    ],
)
def test_combinations_it_does_not_run_are_refused_before_start(override, needle):
    msgs = problems(load_config(["preset=tiny", "pipeline.mode=fully_async", *override.split()]))
    assert any(needle in m for m in msgs), msgs


@pytest.mark.ray
def test_lora_runs_in_the_mode(tmp_path, ray_session):
    out = tmp_path / "run"
    train(_cfg(out, 1, 3, "trainer.val_before_train=false", "actor.lora.rank=8"))
    assert [m["step"] for m in _steps(out)] == [1, 2, 3]


@pytest.mark.parametrize("mode,stored", [("fully_async", "batch"), ("batch", "fully_async")])
def test_a_checkpoint_with_samples_ahead_resumes_in_its_own_mode(mode, stored):
    from offstep.errors import ConfigError
    from offstep.pipeline.batch_source import check_mode_of
    from offstep.pipeline.checkpoints import TrainerState
    from offstep.pipeline.dynamic_sampling import Generated

    ahead = [(3, 0, [1, 2], Generated())] if stored == "batch" else []
    groups = {"admitted": 8, "drawn": [], "epoch": 0, "groups": [{"g": 6}]} if stored == "fully_async" else None
    state = TrainerState(2, 2, 0.0, {}, ahead, 0, None, groups)
    with pytest.raises(ConfigError, match=f"resume with pipeline.mode={stored}"):
        check_mode_of(state, load_config(["preset=tiny", f"pipeline.mode={mode}"]), "ckpt")
    check_mode_of(state, load_config(["preset=tiny", f"pipeline.mode={stored}"]), "ckpt")  # its own mode: fine


def test_must_take_counts_the_groups_later_steps_could_not_fit():
    """Earliest deadline first (a group admitted at version a is due by a + k), B = 2, k = 1."""
    from types import SimpleNamespace

    from offstep.pipeline.sample_stream import must_take

    def groups(*versions):
        return [SimpleNamespace(version=v) for v in versions]

    # Trainer version 3: two groups of version 2 are due now (deadline 3), the rest can wait.
    assert must_take(groups(2, 2, 3, 3), 3, 1, 2) == 2
    # Four groups due by version 4: two now, two at the next step.
    assert must_take(groups(3, 3, 3, 3), 3, 1, 2) == 2
    # Three due by 4 and one more due by 5: one now (two fit the next step), nothing forced after.
    assert must_take(groups(3, 3, 3, 4), 3, 1, 2) == 1
    # Nothing due soon: nothing forced; the batch takes whatever finished.
    assert must_take(groups(3, 4), 3, 1, 2) == 0 and must_take([], 3, 1, 2) == 0
    # k = 0: every group waiting is due now (the synchronous loop).
    assert must_take(groups(3, 3), 3, 0, 2) == 2
