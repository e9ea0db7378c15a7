"""reward.model.*: the keys are typed and checked before any worker starts (docs/reward-models.md)."""

import json

import pytest

from offstep.errors import ModelError
from offstep.launch.loader import load_config
from offstep.launch.validate import problems
from offstep.models.reward_models import check_reward_model
from tests.reward_model_helpers import build_classifier


def _problems(*overrides):
    return problems(load_config(["preset=tiny", *overrides]))


def test_defaults_have_no_reward_model_and_no_problem():
    cfg = load_config(["preset=tiny"])
    assert cfg.reward.model.kind is None and cfg.reward.needs_rule
    assert _problems() == []


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["reward.model.kind=neural"], "reward.model.kind='neural' is not one of"),
        (["reward.model.kind=discriminative"], "reward.model.kind=discriminative needs reward.model.path"),
        (["reward.model.path=/x"], "reward.model.path='/x' is set but reward.model.kind is null"),
        (
            ["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.parser=last"],
            "reward.model.parser='last'",
        ),
        (
            ["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.parser='regex:[0-9]+'"],
            "has no group",
        ),
        (
            ["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.template='Q {question}'"],
            "has no {response}",
        ),
        (
            ["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.template=yesno"],
            "is not one of the named templates ['score', 'yes_no']",
        ),
        (
            ["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.template='{response} {answer}'"],
            "['answer']",
        ),
        (
            ["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.combine=abstain"],
            "set reward.custom_path",
        ),
        (
            ["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.timeout_s=0"],
            "reward.model.timeout_s=0",
        ),
        (["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.weight=0"], "both 0"),
        (
            ["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.placement=cloud"],
            "reward.model.placement='cloud' is not one of ['rollout', 'pool']",
        ),
        (
            ["reward.model.kind=generative", "reward.model.path=tiny", "resources.reward_workers=0"],
            "resources.reward_workers=0",
        ),
        (["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.max_restarts=-1"], "max_restarts=-1"),
        (
            ["reward.model.kind=generative", "reward.model.path=tiny", "reward.model.engine=sglang"],
            "reward.model.engine='sglang' is not one of",
        ),
        (
            ["reward.model.kind=discriminative", "reward.model.path=/x", "reward.model.engine=vllm"],
            "set reward.model.engine=builtin",
        ),
        (
            [
                "reward.model.kind=generative",
                "reward.model.path=tiny",
                "reward.model.engine=vllm",
                "rollout.engine=vllm",
            ],
            "two vLLM engines in one replica's process; put the judge in a pool of its own (reward.model.placement=pool)",
        ),
    ],
)
def test_bad_values_are_named_with_their_fix(overrides, needle):
    found = _problems(*overrides)
    assert any(needle in p for p in found), found


def test_a_model_alone_needs_no_rule_but_a_weighted_rule_does():
    assert not load_config(["preset=tiny", "reward.model.kind=generative", "reward.model.path=tiny"]).reward.needs_rule
    assert load_config(
        ["preset=tiny", "reward.model.kind=generative", "reward.model.path=tiny", "reward.model.rule_weight=0.5"]
    ).reward.needs_rule


def test_the_folder_must_hold_a_model_of_the_kind(tmp_path, tiny):
    path, tok, _, _ = tiny
    rm = build_classifier(tmp_path / "rm", "llama", tok)
    check_reward_model("discriminative", str(rm))
    check_reward_model("generative", "tiny")
    check_reward_model("generative", path)
    with pytest.raises(ModelError, match="not a sequence-classification reward model.*kind=generative"):
        check_reward_model("discriminative", path)  # a causal LM
    with pytest.raises(ModelError, match="no language-model head"):
        check_reward_model("generative", str(rm))
    with pytest.raises(ModelError, match="reward.model.path='/nowhere' does not exist"):
        check_reward_model("discriminative", "/nowhere")
    cfg = json.loads((rm / "config.json").read_text())
    (rm / "config.json").write_text(json.dumps({**cfg, "auto_map": {"AutoModel": "x.Y"}}))
    with pytest.raises(ModelError, match="trust_remote_code=true"):
        check_reward_model("discriminative", str(rm))
    check_reward_model("discriminative", str(rm), trust_remote_code=True)
    (rm / "config.json").write_text(json.dumps(cfg))
    for f in rm.glob("*.safetensors"):
        f.rename(f.with_suffix(".bin"))
    with pytest.raises(ModelError, match="safetensors only"):
        check_reward_model("discriminative", str(rm))


def test_the_preflight_reports_a_wrong_folder(tmp_path):
    from offstep.launch.preflight import environment_problems

    cfg = load_config(
        [
            "preset=tiny",
            "reward.model.kind=discriminative",
            "reward.model.path=tiny",
            f"trainer.output_dir={tmp_path / 'run'}",
        ]
    )
    found = environment_problems(cfg, cpu_count=8, gpu_count=0)
    assert any(p.startswith("reward.model.path='tiny' does not exist") for p in found), found


def test_the_preflight_counts_the_reward_pool(tmp_path):
    from offstep.launch.preflight import environment_problems

    base = [
        "preset=tiny",
        "reward.model.kind=generative",
        "reward.model.path=tiny",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    assert not [p for p in environment_problems(load_config(base), cpu_count=2, gpu_count=0) if "CPU cores" in p]
    pool = load_config([*base, "reward.model.placement=pool", "resources.cpus_per_reward_worker=2"])
    found = [p for p in environment_problems(pool, cpu_count=2, gpu_count=0) if "CPU cores" in p]
    assert found and "needs 4 CPU cores" in found[0] and "resources.cpus_per_reward_worker" in found[0], found


def test_help_shows_the_reward_model_keys(capsys):
    """`offstep train --help reward.model` (docs/reward-models.md)."""
    from offstep.cli import main

    assert main(["train", "--help", "reward.model"]) == 0
    out = capsys.readouterr().out
    for key in ("kind", "path", "combine", "timeout_s", "fallback_score", "parser", "placement"):
        assert f"reward.model.{key}:" in out, key
