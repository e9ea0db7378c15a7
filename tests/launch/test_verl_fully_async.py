"""verl's fully-async command lines in offstep (offstep/launch/verl/fully_async.py):
verl's twelve scripts of verl/experimental/fully_async_policy/shell/ (their arguments are the
fixtures in tests/verl_fully_async/) each fail in one message listing all their refusals, none
of them an async key; without the refused keys each resolves to pipeline.mode=fully_async with
the keys expected. Then each conversion on its own, by hand: a step per weight sync, staleness,
partial rollouts, the old log-probs, the run's length, validation, the engine, the entry point."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from offstep.cli import main
from offstep.launch.loader import ConfigError, load_config
from offstep.launch.validate import problems

SCRIPTS = Path(__file__).resolve().parents[1] / "verl_fully_async"
ROWS = 600  # training rows of the synthetic data the scripts read here


def recorded_args(file: Path, swap: dict[str, str] | None = None, fill: dict[str, str] | None = None) -> list[str]:
    """The arguments recorded in ``file`` (one a line, ``#`` comments), the value of each key in
    ``swap`` replaced and each ``{placeholder}`` named in ``fill`` filled in."""
    args = [a for a in file.read_text().splitlines() if a and not a.startswith("#")]
    swap, fill = swap or {}, fill or {}
    args = [f"{a.split('=')[0]}={swap[a.split('=')[0]]}" if a.split("=")[0] in swap else a for a in args]
    return [re.sub(r"\{(\w+)\}", lambda m: fill.get(m[1], m[0]), a) for a in args]


def script_args(name: str, train: str, val: str) -> list[str]:
    """A script's arguments, its data files replaced by the synthetic ones."""
    return recorded_args(SCRIPTS / f"{name}.args", {"data.train_files": train, "data.val_files": val})


def key_of(arg: str) -> str:
    return arg.lstrip("+").split("=")[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from offstep.data.tasks import write_task

    return write_task("gsm8k_synthetic", str(tmp_path_factory.mktemp("gsm8k")), ROWS, 4, 0)


def load(args):
    notes: list[str] = []
    return load_config(list(args), notes), notes


def at(cfg, key):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


# The FSDP2 DAPO scripts resolve as written: override_config, val_kwargs.top_p, data.truncation=left
# and ulysses_sequence_parallel_size (a note) are translated.
_FSDP: set[str] = set()
_SP: set[str] = set()
_GRPO = {"--config-name"}
MEGATRON = "megatron"  # scripts whose Megatron keys (and optimizer overrides) are refused too

# script: (refused keys besides the Megatron ones, what the rest resolves to). Steps: floor(min(
# total_rollout_steps, 600 rows x epochs) / batch); batch = trigger x require x ppo_mini_batch_size.
SCRIPT_CASES = {
    "dapo_30b_a3b_base_math_fsdp": (
        _FSDP | _SP,
        dict(batch=16 * 1 * 32, mini=32 * 16, steps=6000 // 512, k=1, correction="bypass", val=25, workers=(16, 16)),
    ),
    "dapo_7b_async_retool": (
        {"data.custom_cls.path"},
        dict(batch=4 * 1 * 16, mini=16 * 16, steps=6000 // 64, k=1, correction="bypass", val=10, workers=(4, 4)),
    ),
    "dapo_7b_math_fsdp2_4_4": (
        _FSDP,
        dict(batch=4 * 4 * 32, mini=512, steps=6000 // 512, k=1, correction="bypass", val=10, workers=(4, 4)),
    ),
    "dapo_7b_math_fsdp2_4_12": (
        _FSDP,
        dict(batch=512, mini=512, steps=11, k=1, correction="bypass", val=10, workers=(12, 4)),
    ),
    "dapo_7b_math_fsdp2_8_8": (
        _FSDP,
        dict(batch=512, mini=512, steps=11, k=1, correction="bypass", val=10, workers=(8, 8)),
    ),
    "dapo_7b_math_fsdp2_16_16": (
        _FSDP | _SP,
        dict(batch=512, mini=512, steps=11, k=1, correction="bypass", val=20, workers=(16, 16)),
    ),
    "dapo_7b_math_fsdp2_32_32": (
        _FSDP | _SP,
        dict(batch=512, mini=512, steps=11, k=1, correction="bypass", val=20, workers=(32, 32)),
    ),
    "dapo_7b_math_fsdp2_64_64": (
        _FSDP | _SP,
        dict(batch=512, mini=512, steps=11, k=1, correction="bypass", val=20, workers=(64, 64)),
    ),
    "dapo_7b_math_fsdp2_64_64_mis": (
        _FSDP | _SP,
        dict(batch=512, mini=512, steps=11, k=1, correction="decoupled", val=20, workers=(64, 64)),
    ),
    # 200 epochs: total_rollout_steps=51200 is below 600 x 200, so it counts
    "geo3k_qwen25vl_7b_megatron_4_4": (
        {"--config-name", MEGATRON},
        dict(batch=4 * 2 * 128, mini=128 * 4, steps=51200 // 1024, k=1, correction="bypass", val=5, workers=(4, 4)),
    ),
    "grpo_30b_a3b_base_math_megatron_96_32": (
        _GRPO | {MEGATRON},
        dict(batch=4 * 1 * 128, mini=128 * 16, steps=11, k=1, correction="bypass", val=20, workers=(32, 96)),
    ),
    "grpo_30b_a3b_base_math_megatron_96_32_mis": (
        _GRPO | {MEGATRON},
        dict(batch=512, mini=2048, steps=11, k=1, correction="decoupled", val=20, workers=(32, 96)),
    ),
}


def test_every_script_of_verls_shell_folder_is_checked():
    assert sorted(p.stem for p in SCRIPTS.glob("*.args")) == sorted(SCRIPT_CASES)


@pytest.mark.parametrize("name", sorted(SCRIPT_CASES))
def test_verl_fully_async_script(name, data):
    refused, want = SCRIPT_CASES[name]
    args = script_args(name, *data)
    # as verl wrote it: one message listing every refusal (of the translation and of the
    # derivations), each naming its key; no async key among them
    expect = {
        key_of(a)
        for a in args
        if key_of(a) in refused or MEGATRON in refused and (".megatron." in a or "override_optimizer_config" in a)
    }
    if expect:
        with pytest.raises(ConfigError) as e:
            load(args)
        said = (
            re.findall(r"^  - (?:verl key |verl's )?([-\w.]+)[=:]", str(e.value), re.M)  # several refusals
            or re.findall(r"^verl key ([-\w.]+)=", str(e.value))
        )  # one alone, on its line
        assert set(said) == expect and len(said) == len(expect), str(e.value)
        assert len(expect) == 1 or str(e.value).startswith(f"{len(expect)} verl keys cannot run as given")
        assert not [k for k in said if k.startswith("async_training.") or k.startswith("rollout.")]
    # without the refused keys: verl's fully-async trainer, key by key
    cfg, notes = load([a for a in args if key_of(a) not in expect])
    got = {
        "pipeline.mode": "fully_async",
        "data.train_batch_size": want["batch"],
        "actor.mini_batch_size": want["mini"],
        "trainer.total_steps": want["steps"],
        "pipeline.max_staleness": want["k"],
        "rollout.partial": "recompute",
        "algorithm.correction_mode": want["correction"],
        "rollout.engine": "vllm",
        "trainer.val_freq": want["val"],
        "resources.trainer_workers": want["workers"][0],
        "rollout.replicas": want["workers"][1],
    }
    assert {k: at(cfg, k) for k in got} == got
    assert any("verl's fully-async trainer -> pipeline.mode=fully_async" in n for n in notes)
    # dapo_7b_math_fsdp2_4_12 too: its 512 x 16 samples a step are split unevenly over 12 trainer
    # workers (offstep.train.shards), as verl balances them
    assert problems(cfg) == []


# ------------------------------------------------------------------ each conversion, by hand

TINY = ["preset=tiny", "rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]


def test_a_step_is_what_verls_trainer_does_between_two_weight_syncs():
    # 3 local updates of 2 x 2 prompts between syncs: 12 prompts a step, mini-batches of 2 x 2 sequences
    cfg, notes = load(
        [
            *TINY,
            "async_training.trigger_parameter_sync_step=3",
            "async_training.require_batches=2",
            "data.train_batch_size=0",
        ]
    )
    assert (cfg.pipeline.mode, cfg.data.train_batch_size, cfg.actor.mini_batch_size) == ("fully_async", 12, 4)
    assert any("-> data.train_batch_size=12 prompts" in n and "6 updates a step" in n for n in notes), notes
    # verl's defaults beside the key given (trigger 4, require 1); offstep's mini-batch without ppo_mini_batch_size
    cfg, _ = load([*TINY, "async_training.require_batches=2"])
    assert cfg.data.train_batch_size == 4 * 2 * 2
    cfg, _ = load(["preset=tiny", "rollout.n=2", "actor.mini_batch_size=6", "async_training.require_batches=1"])
    assert cfg.data.train_batch_size == 4 * 1 * 3
    # verl takes data.train_batch_size=0 only; the same number is accepted, another refused
    cfg, _ = load([*TINY, "async_training.require_batches=1", "data.train_batch_size=8"])
    assert cfg.data.train_batch_size == 8
    with pytest.raises(ConfigError, match=r"data.train_batch_size=16: verl's fully-async mode takes 0.*4 x 1 x 2 = 8"):
        load([*TINY, "async_training.require_batches=1", "data.train_batch_size=16"])
    with pytest.raises(ConfigError, match="trigger_parameter_sync_step=0: must be >= 1"):
        load([*TINY, "async_training.trigger_parameter_sync_step=0"])
    # ppo_epochs > 1 orders the updates differently: said
    _, notes = load([*TINY, "async_training.trigger_parameter_sync_step=2", "actor_rollout_ref.actor.ppo_epochs=2"])
    assert any(n.startswith("actor.ppo_epochs=2: verl runs the epochs over each") for n in notes)


@pytest.mark.parametrize("threshold,k", [(0, 0), (0.1, 1), (0.5, 1), (1, 1), (1.0, 1), (1.5, 2), (3, 3)])
def test_staleness_threshold_is_ceil(threshold, k):
    cfg, notes = load([*TINY, f"async_training.staleness_threshold={threshold}"])
    assert cfg.pipeline.max_staleness == k
    assert any(
        n.startswith(f"async_training.staleness_threshold={threshold} -> pipeline.max_staleness={k} (ceil")
        for n in notes
    )


def test_staleness_threshold_refusals_and_conflicts():
    with pytest.raises(ConfigError, match="staleness_threshold=-0.5: expected a number >= 0"):
        load([*TINY, "async_training.staleness_threshold=-0.5"])
    with pytest.raises(
        ConfigError,
        match="pipeline.max_staleness is given twice: directly and as verl's async_training.staleness_threshold",
    ):
        load([*TINY, "async_training.staleness_threshold=0.5", "pipeline.max_staleness=2"])
    cfg, _ = load([*TINY, "async_training.partial_rollout=True", "pipeline.max_staleness=2"])  # offstep's own key stays
    assert cfg.pipeline.max_staleness == 2


def test_partial_rollout_is_recompute_as_verl_resubmits_the_prefix():
    cfg, notes = load([*TINY, "async_training.partial_rollout=True"])
    assert cfg.rollout.partial == "recompute"
    assert any("resubmits prompt + tokens so far" in n for n in notes)
    cfg, _ = load([*TINY, "async_training.partial_rollout=False"])
    assert cfg.rollout.partial == "off"
    cfg, notes = load([*TINY, "async_training.partial_rollout=True", "async_training.staleness_threshold=0"])
    assert (cfg.rollout.partial, cfg.pipeline.max_staleness) == ("recompute", 0)
    assert any("no sample crosses a load" in n for n in notes)
    cfg, _ = load([*TINY, "async_training.require_batches=1"])  # not given: offstep's default
    assert cfg.rollout.partial == "keep"
    with pytest.raises(ConfigError, match="partial_rollout='yes': expected true or false"):
        load([*TINY, "async_training.partial_rollout=yes"])


@pytest.mark.parametrize(
    "use,prox,mode", [(True, False, "bypass"), (True, True, "decoupled"), (False, False, "decoupled")]
)
def test_old_log_probs(use, prox, mode):
    cfg, notes = load(
        [*TINY, f"async_training.use_rollout_log_probs={use}", f"async_training.compute_prox_log_prob={prox}"]
    )
    assert cfg.algorithm.correction_mode == mode
    if not use:
        assert any("only when trigger_parameter_sync_step=1" in n for n in notes)


def test_old_log_probs_defaults_and_conflict():
    cfg, _ = load([*TINY, "async_training.compute_prox_log_prob=True"])  # use_rollout_log_probs: verl's true
    assert cfg.algorithm.correction_mode == "decoupled"
    cfg, _ = load([*TINY, "async_training.use_rollout_log_probs=True"])
    assert cfg.algorithm.correction_mode == "bypass"
    cfg, _ = load([*TINY, "async_training.use_rollout_log_probs=True", "algorithm.rollout_correction.bypass_mode=True"])
    assert cfg.algorithm.correction_mode == "bypass"
    with pytest.raises(ConfigError, match="bypass_mode=False: .*is algorithm.correction_mode=bypass"):
        load([*TINY, "async_training.use_rollout_log_probs=True", "algorithm.rollout_correction.bypass_mode=False"])


def test_the_runs_length_is_verls_weight_versions():
    # built-in task of 50 rows; a step of 4 x 1 x 2 = 8 prompts
    base = [*TINY, "data.task_train_size=50", "async_training.require_batches=1"]
    cfg, notes = load([*base, "rollout.total_rollout_steps=100"])
    assert cfg.trainer.total_steps == 100 // 8  # min(100, 50 x 10 epochs) / 8
    cfg, _ = load([*base, "rollout.total_rollout_steps=100", "rollout.total_epochs=1"])
    assert cfg.trainer.total_steps == 50 // 8  # min(100, 50 x 1) / 8
    cfg, _ = load([*base, "rollout.total_rollout_steps=100", "trainer.total_epochs=1", "rollout.total_epochs=5"])
    assert cfg.trainer.total_steps == 50 // 8  # the smaller of the two epoch counts
    cfg, _ = load([*base, "rollout.total_rollout_steps=null", "trainer.total_epochs=2"])
    assert cfg.trainer.total_steps == 100 // 8  # no cap of its own: rows x min(2, 10)
    cfg, notes = load([*base, "trainer.total_epochs=1"])
    assert cfg.trainer.total_steps == 50 // 8  # verl's default total_rollout_steps=100 is above 50 x 1
    assert any("(verl default), capped at 50 rows x 1 epochs" in n for n in notes)
    with pytest.raises(ConfigError, match=r"rollout.total_rollout_steps=4: 4 prompts .*do not fill one step of 8"):
        load([*base, "rollout.total_rollout_steps=4"])
    # verl's fully-async trainer ignores total_training_steps: noted, offstep's step count stays
    cfg, notes = load([*base, "trainer.total_training_steps=7"])
    assert cfg.trainer.total_steps == load(TINY)[0].trainer.total_steps != 7  # preset=tiny's
    assert (
        "trainer.total_training_steps: accepted, no effect (verl's fully-async trainer counts rollout.total_rollout_steps)"
        in notes
    )
    # the warm-up ratio counts the translated steps
    cfg, _ = load([*base, "rollout.total_rollout_steps=80", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5"])
    assert (cfg.trainer.total_steps, cfg.actor.optim.warmup_steps) == (10, 5)


def test_validation_every_rollout_test_freq_versions():
    cfg, _ = load([*TINY, "rollout.test_freq=3"])
    assert cfg.trainer.val_freq == 3
    cfg, _ = load([*TINY, "rollout.test_freq=-1"])
    assert cfg.trainer.val_freq == 0
    cfg, notes = load([*TINY, "rollout.test_freq=3", "trainer.test_freq=7"])
    assert cfg.trainer.val_freq == 3 and any(n.startswith("trainer.test_freq: accepted, no effect") for n in notes)
    cfg, notes = load([*TINY, "async_training.require_batches=1", "trainer.test_freq=7"])
    assert cfg.trainer.val_freq == 7 and any("reads rollout.test_freq instead" in n for n in notes)


def test_the_engine_translates_as_in_batch_mode():
    """Both engines run pipeline.mode=fully_async: verl's rollout.name keeps its batch-mode meaning."""
    cfg, _ = load([*TINY, "actor_rollout_ref.rollout.name=vllm", "async_training.require_batches=1"])
    assert cfg.rollout.engine == "vllm"
    assert problems(cfg) == []
    cfg, _ = load([*TINY, "actor_rollout_ref.rollout.name=sglang", "async_training.require_batches=1"])
    assert cfg.rollout.engine == "vllm"
    cfg, _ = load([*TINY, "actor_rollout_ref.rollout.name=hf", "async_training.require_batches=1"])
    assert cfg.rollout.engine == "builtin"


def test_entry_point_config_and_mode():
    # verl's fully-async config names the mode, with nothing else of it given
    cfg, notes = load([*TINY, "--config-path=config", "--config-name='fully_async_ppo_trainer.yaml'"])
    assert cfg.pipeline.mode == "fully_async" and cfg.data.train_batch_size == 4 * 1 * 2
    assert any(n.startswith("--config-path=config: accepted, no effect") for n in notes)
    cfg, notes = load([*TINY, "--config-name=ppo_trainer"])
    assert cfg.pipeline.mode == "batch" and any(n.startswith("--config-name=ppo_trainer: accepted") for n in notes)
    with pytest.raises(
        ConfigError, match="--config-name=fully_async_ppo_megatron_trainer is refused: offstep trains with FSDP2"
    ):
        load([*TINY, "--config-name=fully_async_ppo_megatron_trainer"])
    # without verl's async keys offstep's own mode is untouched; with them, pipeline.mode=batch conflicts
    cfg, _ = load([*TINY, "data.train_batch_size=8"])
    assert (cfg.pipeline.mode, cfg.data.train_batch_size) == ("batch", 8)
    cfg, _ = load([*TINY, "pipeline.mode=fully_async", "async_training.require_batches=1"])
    assert cfg.pipeline.mode == "fully_async"
    with pytest.raises(ConfigError, match="pipeline.mode=batch with verl's fully-async keys"):
        load([*TINY, "pipeline.mode=batch", "async_training.require_batches=1"])


def test_noted_and_unknown_async_keys():
    cfg, notes = load(
        [
            *TINY,
            "async_training.use_trainer_do_validate=False",
            "async_training.checkpoint_engine.enable=True",
            "async_training.checkpoint_engine.device_buffer_size_M=4096",
            "data.gen_batch_size=1",
        ]
    )
    for key in (
        "async_training.use_trainer_do_validate",
        "async_training.checkpoint_engine.enable",
        "async_training.checkpoint_engine.device_buffer_size_M",
        "data.gen_batch_size",
    ):
        assert any(n.startswith(key) and "no effect" in n for n in notes), key
    with pytest.raises(ConfigError, match="async_training.something_new: a verl key that offstep does not know"):
        load([*TINY, "async_training.something_new=1"])
    with pytest.raises(ConfigError, match="data.gen_batch_size=64 is refused"):
        load([*TINY, "data.gen_batch_size=64"])


def test_every_refusal_in_one_message():
    # refused by the table, by a derivation, and a conflict: all three at once
    with pytest.raises(ConfigError) as e:
        load(
            [
                *TINY,
                "actor_rollout_ref.rollout.expert_parallel_size=2",
                "data.truncation=sideways",
                "async_training.staleness_threshold=1",
                "pipeline.max_staleness=3",
            ]
        )
    text = str(e.value)
    assert text.startswith("3 verl keys cannot run as given")
    for part in (
        "expert_parallel_size=2 is refused",
        "data.truncation='sideways'",
        "pipeline.max_staleness is given twice",
    ):
        assert part in text, text


def test_offstep_train_cfg_prints_the_fully_async_config(capsys, tmp_path):
    rc = main(
        [
            "train",
            "--cfg",
            *TINY,
            f"trainer.output_dir={tmp_path}",
            "async_training.staleness_threshold=0.5",
            "async_training.partial_rollout=True",
            "async_training.trigger_parameter_sync_step=2",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "mode: fully_async" in out.out and "partial: recompute" in out.out and "train_batch_size: 4" in out.out
    assert "verl's fully-async trainer -> pipeline.mode=fully_async" in out.err
