"""verl values that have a faithful offstep equivalent are translated, not refused: DAPO's group
filter and overlong buffer, prompt truncation, validation sampling, model config overrides,
rollout_is_threshold=null, ``~key``; verl config files (--config-path/--config-name); and every
problem of a command line, verl's and offstep's, in one message."""

from __future__ import annotations

import json

import pytest

from offstep.cli import main
from offstep.launch.loader import ConfigError, load_config

TINY = ["preset=tiny", "rollout.n=2"]


def load(args):
    notes: list[str] = []
    return load_config(list(args), notes), notes


def test_dapo_filter_groups_is_dynamic_sampling():
    # verl: rounds of 32 prompts, at most 10, until 16 groups with unequal accuracy are kept;
    # offstep's rounds have 16 prompts: ceil(10 x 32 / 16) = 20 rounds for the same prompts
    cfg, notes = load(
        [
            *TINY,
            "data.train_batch_size=16",
            "data.gen_batch_size=32",
            "algorithm.filter_groups.enable=True",
            "algorithm.filter_groups.metric=acc",
            "algorithm.filter_groups.max_num_gen_batches=10",
        ]
    )
    assert cfg.algorithm.dynamic_sampling and cfg.algorithm.dynamic_sampling_max_attempts == 20
    assert any("topped up with equal-score groups" in n for n in notes)
    # 0 is verl's unlimited: offstep keeps its bound, and says so
    cfg, notes = load([*TINY, "algorithm.filter_groups.enable=True", "algorithm.filter_groups.max_num_gen_batches=0"])
    assert cfg.algorithm.dynamic_sampling_max_attempts == 10 and any("verl: unlimited" in n for n in notes)
    # seq_reward includes the overlong penalty, which offstep's filter does not see: refused
    with pytest.raises(ConfigError, match="filter_groups.metric='seq_reward'"):
        load(
            [
                *TINY,
                "algorithm.filter_groups.enable=True",
                "algorithm.filter_groups.metric=seq_reward",
                "reward_model.overlong_buffer.enable=True",
            ]
        )
    cfg, _ = load([*TINY, "algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=seq_reward"])
    assert cfg.algorithm.dynamic_sampling


def test_gen_batch_size_without_filter_groups():
    cfg, notes = load(
        [*TINY, "data.train_batch_size=8", "data.gen_batch_size=8", "algorithm.filter_groups.enable=False"]
    )
    assert not cfg.algorithm.dynamic_sampling and any(n.startswith("data.gen_batch_size=8: accepted") for n in notes)
    with pytest.raises(ConfigError, match="data.gen_batch_size=32 is refused"):
        load([*TINY, "data.train_batch_size=8", "data.gen_batch_size=32"])


def test_dapo_recipes_overlong_buffer_is_the_overlong_penalty():
    # the DAPO recipe's own keys; before, they fell under the reward_model.* note (penalty silently off)
    cfg, notes = load(
        [
            *TINY,
            "rollout.max_new_tokens=64",
            "reward_model.overlong_buffer.enable=True",
            "reward_model.overlong_buffer.len=16",
            "reward_model.overlong_buffer.penalty_factor=0.5",
            "reward_model.overlong_buffer.log=False",
        ]
    )
    a = cfg.algorithm
    assert (a.overlong_penalty, a.overlong_buffer_len, a.overlong_penalty_factor) == (True, 16, 0.5)
    assert not [n for n in notes if "overlong_buffer.enable" in n and "no effect" in n]
    # with the reward manager's spelling of the same keys too (as the fully-async DAPO scripts give them)
    cfg, _ = load(
        [
            *TINY,
            "reward_model.overlong_buffer.enable=True",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
        ]
    )
    assert cfg.algorithm.overlong_penalty


@pytest.mark.parametrize("how", ["left", "right", "middle", "error"])
def test_truncation(how):
    cfg, _ = load([*TINY, "data.filter_overlong_prompts=False", f"data.truncation={how}"])
    assert cfg.data.overlong_prompts == how
    cfg, _ = load([*TINY, "data.filter_overlong_prompts=True", f"data.truncation={how}"])  # verl filters first
    assert cfg.data.overlong_prompts == "filter"


def test_val_kwargs_are_validation_sampling():
    cfg, _ = load(
        [
            *TINY,
            "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
            "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
            "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
            "actor_rollout_ref.rollout.val_kwargs.n=3",
        ]
    )
    r = cfg.rollout
    assert (r.val_top_p, r.val_top_k, r.val_temperature, r.val_n) == (0.7, 0, 1.0, 3)
    cfg, _ = load([*TINY, "actor_rollout_ref.rollout.val_kwargs.top_k=20"])
    assert cfg.rollout.val_top_k == 20


def test_override_config_reaches_the_models_config(tmp_path):
    from offstep.models.loading import ModelError, resolve_model, with_config_overrides

    cfg, notes = load(
        [
            *TINY,
            "+actor_rollout_ref.model.override_config.attention_dropout=0.1",
            "+actor_rollout_ref.model.override_config.rope_scaling.type=linear",
        ]
    )
    assert cfg.model.override_config == {"attention_dropout": 0.1, "rope_scaling": {"type": "linear"}}
    assert any("-> model.override_config.attention_dropout" in n for n in notes)
    cfg, _ = load([*TINY, "actor_rollout_ref.model.override_config={attention_dropout: 0.2}"])  # verl's whole-dict form
    assert cfg.model.override_config == {"attention_dropout": 0.2}
    cfg, _ = load([*TINY, "actor_rollout_ref.model.override_config={}"])
    assert cfg.model.override_config == {}
    folder = resolve_model("tiny")
    assert with_config_overrides(folder, {}, tmp_path) == folder
    out = with_config_overrides(folder, {"attention_dropout": 0.1}, tmp_path)
    assert json.loads((tmp_path / "model_override_config" / "config.json").read_text())["attention_dropout"] == 0.1
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(out).attention_dropout == 0.1
    with pytest.raises(ModelError, match="not_a_setting"):
        with_config_overrides(folder, {"not_a_setting": 1}, tmp_path / "b")


def test_rollout_is_threshold_null_is_off():
    cfg, notes = load(
        [
            *TINY,
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=null",
        ]
    )
    assert cfg.algorithm.tis is False
    cfg, _ = load(
        [
            *TINY,
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_is_threshold=3.0",
        ]
    )
    assert cfg.algorithm.tis and cfg.algorithm.tis_cap == 3.0


def test_tilde_deletes_a_key():
    cfg, notes = load([*TINY, "actor_rollout_ref.rollout.temperature=0.5", "~actor_rollout_ref.rollout.temperature"])
    assert cfg.rollout.temperature == 1.0 and any(
        n.startswith("~actor_rollout_ref.rollout.temperature: deleted") for n in notes
    )
    cfg, _ = load([*TINY, "rollout.top_p=0.5", "~rollout.top_p"])  # an offstep key too
    assert cfg.rollout.top_p == 1.0
    cfg, _ = load([*TINY, "~actor_rollout_ref.rollout.top_p"])  # nothing to delete: no error
    assert cfg.rollout.top_p == 1.0


def test_sequence_parallelism_is_one_note():
    cfg, notes = load(
        [
            *TINY,
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=4",
            "actor_rollout_ref.ref.ulysses_sequence_parallel_size=4",
        ]
    )
    said = [n for n in notes if "sequence parallelism" in n]
    assert len(said) == 1 and "actor.ulysses" in said[0] and "ref.ulysses" in said[0], notes


# verl's examples/sglang_multiturn/config/*.yaml have this shape: hydra.searchpath to verl's
# configs, defaults [ppo_trainer, _self_], then the keys they change (written here, not copied).
MULTI_TURN = """\
hydra:
  searchpath:
    - file://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
data:
  max_prompt_length: 96
  max_response_length: 24
  train_batch_size: 8
  gen_batch_size: ${data.train_batch_size}
  return_raw_chat: True
actor_rollout_ref:
  hybrid_engine: True
  rollout:
    name: hf
    multi_turn:
      enable: True
      max_assistant_turns: 3
algorithm:
  filter_groups:
    _target_: verl.trainer.config.FilterGroupsConfig
    enable: False
"""


@pytest.mark.parametrize("style", ["space", "equals"])
def test_verl_config_file(tmp_path, style):
    (tmp_path / "multiturn_grpo.yaml").write_text(MULTI_TURN)
    flags = (
        ["--config-path", str(tmp_path), "--config-name", "multiturn_grpo"]
        if style == "space"
        else [f"--config-path={tmp_path}", "--config-name='multiturn_grpo'"]
    )
    cfg, notes = load([*TINY, *flags, "data.train_batch_size=4"])  # the command line on top
    assert (cfg.data.max_prompt_length, cfg.rollout.max_new_tokens, cfg.rollout.agent.max_turns) == (96, 24, 3)
    assert cfg.data.train_batch_size == 4  # and gen_batch_size=${data.train_batch_size} follows it (no refusal)
    assert any("multiturn_grpo.yaml read" in n for n in notes)
    assert any("defaults [ppo_trainer]" in n and "not here" in n for n in notes)
    assert any(n.startswith("actor_rollout_ref.rollout.multi_turn.enable") for n in notes)


def test_verl_config_file_with_a_local_default(tmp_path):
    (tmp_path / "base.yaml").write_text("data:\n  max_prompt_length: 50\n  train_batch_size: 8\n")
    (tmp_path / "run.yaml").write_text("defaults:\n  - base\n  - _self_\ndata:\n  train_batch_size: 6\n")
    cfg, notes = load([*TINY, f"--config-path={tmp_path}", "--config-name=run"])
    assert (cfg.data.max_prompt_length, cfg.data.train_batch_size) == (50, 6)
    assert not any("not here" in n for n in notes)


def test_every_problem_in_one_pass(capsys):
    # a refused verl key, a bad verl value, an unknown verl key and offstep's own check at once
    rc = main(
        [
            "train",
            "--cfg",
            *TINY,
            "actor_rollout_ref.actor.strategy=megatron",
            "data.truncation=sideways",
            "actor_rollout_ref.rollout.something_new=1",
            "algorithm.adv_estimator=grpo",
            "rollout.n=1",
            "algorithm.one_response_groups=zero",
        ]
    )  # offstep's convention, given: n=1 is its check's problem
    err = capsys.readouterr().err
    assert rc == 2
    assert "\noffstep: 4 problems, each with its fix" in err, err  # after the notes
    for part in (
        "strategy='megatron' is refused",
        "data.truncation='sideways'",
        "something_new: a verl key",
        "rollout.n >= 2",
    ):
        assert part in err, err
