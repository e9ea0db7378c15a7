"""The tiny preset trained end to end with a reward model on the rollout replicas (reward.model):
a discriminative one combined with the rule, and a generative judge alone."""

from __future__ import annotations

import os
import time

import pytest
from conftest import ENGINES_SLOW_VLLM

from offstep.launch.loader import load_config
from offstep.models.loading import load_tokenizer, resolve_model
from offstep.pipeline.controller import train
from offstep.telemetry.metrics import read_jsonl
from offstep.telemetry.names import Reward, Stage, Timing, reward_lane
from tests.reward_model_helpers import build_classifier

pytestmark = pytest.mark.ray  # every test here starts Ray


def _run(tmp_path, *extra):
    out = tmp_path / "run"
    train(
        load_config(
            [
                "preset=tiny",
                "trainer.total_steps=2",
                f"trainer.output_dir={out}",
                "trainer.progress=off",
                "trainer.val_before_train=false",
                "trainer.val_freq=-1",
                *extra,
            ]
        )
    )
    return [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1], read_jsonl(out / "timeline.jsonl")


def test_discriminative_reward_model_with_the_rule(tmp_path, ray_session):
    folder = build_classifier(tmp_path / "rm", "llama", load_tokenizer(resolve_model("tiny")))
    metrics, timeline = _run(
        tmp_path,
        "reward.model.kind=discriminative",
        f"reward.model.path={folder}",
        "reward.model.weight=0.5",
        "reward.model.rule_weight=2.0",
    )
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m[Reward.MODEL_FALLBACKS] == 0 and m[Timing.REWARD_MODEL] > 0
        # every sample has both components, so the means combine as the samples do: 2 rule + 0.5 model
        assert m[Reward.MEAN] == pytest.approx(2.0 * m[Reward.RULE_MEAN] + 0.5 * m[Reward.MODEL_MEAN], abs=1e-5)
    lane = [e for e in timeline if e["role"] == reward_lane(0)]
    assert {e["stage"] for e in lane} == {Stage.REWARD_MODEL} and {e["step"] for e in lane} == {1, 2}


def test_fully_async_scores_with_the_reward_model(tmp_path, ray_session):
    """pipeline.mode=fully_async: the stream's groups go out once the reward model scored them."""
    folder = build_classifier(tmp_path / "rm", "qwen2", load_tokenizer(resolve_model("tiny")))
    metrics, timeline = _run(
        tmp_path,
        "pipeline.mode=fully_async",
        "reward.model.kind=discriminative",
        f"reward.model.path={folder}",
        "reward.model.rule_weight=1.0",
    )
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m[Reward.MODEL_FALLBACKS] == 0
        assert m[Reward.MEAN] == pytest.approx(m[Reward.RULE_MEAN] + m[Reward.MODEL_MEAN], abs=1e-5)
    lane = [e for e in timeline if e["role"] == reward_lane(0)]
    assert lane and {e["stage"] for e in lane} == {Stage.REWARD_MODEL} and 1 in {e["step"] for e in lane}


@pytest.mark.parametrize("engine", ENGINES_SLOW_VLLM)
def test_generative_judge_alone(tmp_path, ray_session, engine):
    """On either engine (reward.model.engine); the vLLM judge in a pool of its own."""
    where = (
        ["reward.model.placement=pool", "pipeline.max_staleness=0", "pipeline.colocate=true"]
        if engine == "vllm"
        else []
    )
    metrics, _ = _run(
        tmp_path,
        "reward.model.kind=generative",
        "reward.model.path=tiny",
        "reward.model.max_new_tokens=4",
        "reward.model.fallback_score=0.25",
        "trainer.total_steps=1",
        f"reward.model.engine={engine}",
        *where,
    )
    (m,) = metrics
    # the random tiny judge writes no number in [0, 1]: every sample falls back, counted, and the run goes on
    n = 4 * 2  # data.train_batch_size x rollout.n of the tiny preset
    assert m[Reward.MODEL_FALLBACKS] == n and m[Reward.MODEL_MEAN] == 0.25 and m[Reward.MEAN] == pytest.approx(0.25)
    assert Reward.RULE_MEAN in m  # the arithmetic rule still scores, for the log, with weight 0


def test_reward_pool_of_its_own(tmp_path, ray_session):
    """reward.model.placement=pool: the replicas send their finished samples to the reward pool (the
    rollout colocated with the trainer, so that the run fits 2 cores)."""
    folder = build_classifier(tmp_path / "rm", "qwen2", load_tokenizer(resolve_model("tiny")))
    metrics, timeline = _run(
        tmp_path,
        "reward.model.kind=discriminative",
        f"reward.model.path={folder}",
        "reward.model.placement=pool",
        "pipeline.max_staleness=0",
        "pipeline.colocate=true",
        "trainer.total_steps=1",
    )
    (m,) = metrics
    assert m[Reward.MODEL_FALLBACKS] == 0 and m[Reward.MEAN] == pytest.approx(m[Reward.MODEL_MEAN], abs=1e-6)
    assert [e["stage"] for e in timeline if e["role"] == reward_lane(0)]  # the round trips, on the replica's lane


def _wait_gone(pid, timeout_s=60.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"reward worker process {pid} still alive {timeout_s:.0f} s after ray.kill")


def test_a_dead_reward_worker_falls_back_and_is_replaced(tmp_path, ray_free, tiny):
    import ray

    from offstep.config.schema import RewardModelConfig
    from offstep.rewards.combine import ModelScore
    from offstep.rollout.scoring.replica_reward_model import build_model_reward
    from offstep.rollout.scoring.reward_worker import RewardWorker

    folder = build_classifier(tmp_path / "rm", "llama", tiny[1])
    m = RewardModelConfig(kind="discriminative", path=str(folder), timeout_s=20.0)
    chat = [{"role": "user", "content": "2+3?"}]
    # as offstep.pipeline.workers.start_reward_pool starts them: Ray restarts a dead one (max_restarts)
    for restarts in (0, 1):
        worker = ray.remote(RewardWorker).options(num_cpus=0.01, max_restarts=restarts).remote(m, "cpu", 1)
        ray.get(worker.__ray_ready__.remote(), timeout=300)  # started (on a busy machine that takes a while)
        batcher = build_model_reward(m, None, pool=[worker])
        first = batcher(chat, "5")
        assert first.status == "ok" and first.value is not None
        pid = ray.get(worker.__ray_call__.remote(lambda _: os.getpid()))
        ray.kill(worker, no_restart=False)  # the process dies, as a crash or an OOM kill would end it
        _wait_gone(pid)  # ray.kill only asks: a call made before the process ends would still be answered
        seen = []
        for _ in range(60 if restarts else 3):  # a sample whose batch hits the dead worker falls back, none hangs
            seen.append(batcher(chat, "5"))
            if seen[-1].status == "ok":
                break
            time.sleep(0.5)
        if restarts:
            assert seen[-1] == first, seen  # the restarted worker (same handle) scores again, the same
            assert all(s == ModelScore(None, "failed") for s in seen[:-1])
        else:
            assert seen == [ModelScore(None, "failed")] * 3
        ray.kill(worker)
