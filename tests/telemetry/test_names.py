"""The names of offstep/telemetry/names.py: each metric key exactly as runs have always written it
(dashboards, ``offstep report`` and the checks of older runs read them), the names made from a
pattern, and the calls the controller makes by method rather than by a string."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from offstep.telemetry import names
from offstep.telemetry.names import Role, replica, replica_index

# Every metric key, spelled out once more on purpose: renaming a constant's value fails here.
METRICS = {
    "timing_s/step",
    "timing_s/gen",
    "timing_s/wait_gen",
    "timing_s/ref",
    "timing_s/ref_rollout",
    "timing_s/values",
    "timing_s/old_logprobs",
    "timing_s/adv",
    "timing_s/update_critic",
    "timing_s/update_actor",
    "timing_s/sync_weights",
    "timing_s/sync_verify",
    "timing_s/reward_model",
    "timing_s/rollout_sleep",
    "timing_s/rollout_wake",
    "timing_s/teacher",
    "perf/tokens_per_s",
    "perf/samples_per_s",
    "perf/gen_tokens_per_s",
    "perf/lent_cores_s",
    "reward/mean",
    "reward/max",
    "reward/min",
    "reward/uniform_group_frac",
    "reward/overlong_penalty",
    "reward/kl_penalty",
    "reward/kl_coef",
    "reward/greedy_baseline",
    "reward/rule/mean",
    "reward/model/mean",
    "reward/model/fallbacks",
    "rollout/staleness_max",
    "rollout/staleness_mean",
    "rollout/version_min",
    "rollout/version_span_max",
    "rollout/partial_samples",
    "rollout/kv_age_max",
    "rollout/queue_depth",
    "rollout/in_flight_groups",
    "rollout/dropped_stale",
    "rollout/length_bias",
    "rollout/dynamic_sampling_attempts",
    "rollout/over_sample_cut",
    "rollout/dynamic_sampling_filled_groups",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "response_length/generated_mean",
    "adv/mean",
    "adv/abs_mean",
    "adv/max",
    "adv/min",
    "distill/reverse_kl",
    "distill/teacher_logprob",
    "actor/pg_loss",
    "actor/kl",
    "actor/entropy",
    "actor/grad_norm",
    "actor/mismatch_kl_k1",
    "actor/is_weight_mean",
    "actor/frozen",
    "sync/verified",
    "sync/collective",
    "sandbox/executions",
    "sandbox/timeouts",
    "sandbox/seconds_mean",
    "sandbox/seconds_p95",
    "sandbox/queue_wait_s",
    "val/acc",
    "val/acc_stderr",
    "val/policy_version",
    "data/prompts_crc32",
}
GROUPS = {
    names.Timing: "timing_s/",
    names.Perf: "perf/",
    names.Reward: "reward/",
    names.Rollout: "rollout/",
    names.ResponseLength: "response_length/",
    names.Adv: "adv/",
    names.Distill: "distill/",
    names.Actor: "actor/",
    names.Sync: "sync/",
    names.Sandbox: "sandbox/",
    names.Val: "val/",
    names.Data: "data/",
}
STAGES = {
    "gen",
    "gen_more",
    "val",
    "ref",
    "tool",
    "load_weights",
    "wait_gen",
    "values",
    "old_logprobs",
    "update_critic",
    "update_actor",
    "sync",
    "sync_export",
    "checkpoint",
    "prepare",
    "reward_model",
    "sleep",
    "wake",
    "teacher",
}


def _values(cls) -> list[str]:
    return [v for k, v in vars(cls).items() if k.isupper() and k != "PREFIX"]


def test_metric_names_are_the_ones_runs_write():
    defined = [v for cls in GROUPS for v in _values(cls)]
    assert len(defined) == len(set(defined)), "a metric name defined twice"
    assert set(defined) == METRICS
    for cls, prefix in GROUPS.items():  # each class holds its own group only
        assert all(v.startswith(prefix) for v in _values(cls)), cls.__name__
    assert names.Val.PREFIX == "val/"


def test_stage_and_role_names():
    assert set(_values(names.Stage)) == STAGES
    assert (Role.TRAINER, Role.DRIVER, Role.ROLLOUT) == ("trainer", "driver", "rollout")
    # the trainer roles' names are also their checkpoint folders
    assert (Role.ACTOR, Role.CRITIC) == ("actor", "critic")


def test_names_from_a_pattern():
    assert replica(0) == "rollout/0" and replica(12) == "rollout/12"
    assert names.reward_lane(2) == "reward/2" and replica_index(names.reward_lane(2)) is None
    assert [replica_index(r) for r in ("rollout/3", "rollout/12", "trainer", "rollout/x", "rollout", "ref/1")] == [
        3,
        12,
        None,
        None,
        None,
        None,
    ]
    assert names.actor("pg_loss") == names.Actor.PG_LOSS and names.critic("vf_loss") == "critic/vf_loss"
    assert names.per_source("val/", "gsm8k", "acc/best@4") == "val/gsm8k/acc/best@4"
    assert names.per_source("", "gsm8k", "acc") == "gsm8k/acc"  # offstep eval's names have no prefix


def test_role_group_calls_a_method_not_a_string():
    """``RoleGroup.submit`` takes the worker class's method and calls the method of that name on
    every rank; a method name as a string fails at once, before anything reaches Ray."""
    from offstep.pipeline.pools import RoleGroup
    from offstep.train.actor import ActorWorker

    def handle(rank):
        return SimpleNamespace(update=SimpleNamespace(remote=lambda *args: ("update", rank, args)))

    group = RoleGroup(Role.ACTOR, [handle(0), handle(1)])
    assert group.submit(ActorWorker.update, "batch") == [("update", 0, ("batch",)), ("update", 1, ("batch",))]
    with pytest.raises(AttributeError):
        group.submit("update", "batch")
    with pytest.raises(AttributeError):  # a method the handles do not have
        group.submit(ActorWorker.export_weights)
