"""verl's own launch scripts in offstep: 16 scripts of the verl repository (their arguments are the
fixtures in tests/verl_scripts/, paths as {placeholders}), each resolved by `offstep train --cfg
--gpus N` with the GPU count the script names, in this process (no Ray), on the tiny model and
synthetic parquet that carries each dataset's data_source. The test checks the translations that
matter for each; the scripts offstep cannot run as given are refused in one message, every problem
with its reason (docs/from-verl.md, "verl's launch scripts")."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
from geo3k_rows import write_geo3k
from omegaconf import OmegaConf
from test_verl_fully_async import recorded_args

from offstep.cli import main
from offstep.launch.loader import load_config

SCRIPTS = Path(__file__).resolve().parents[1] / "verl_scripts"
ROWS = 4096  # training rows: the largest train_batch_size of the scripts (4096 prompts)

# the data_source each script's dataset carries (verl's preprocessing scripts and the DAPO data)
SOURCES = {
    "gsm8k": "openai/gsm8k",
    "math": "DigitalLearningGmbH/MATH-lighteval",
    "dapo_math": "math_dapo",
    "aime": "math_dapo",
}


@pytest.fixture(scope="module")
def fill(tmp_path_factory):
    """The placeholders of the recorded arguments: the tiny model and synthetic data files."""
    from offstep.data.tasks import write_task

    folder = tmp_path_factory.mktemp("verl_data")
    train, val = write_task("gsm8k_synthetic", str(folder / "gsm8k"), ROWS, 8, 0)
    out = {
        "model": "tiny",
        "vl_model": "tiny_vl",
        "geo3k_train": write_geo3k(folder / "geo3k_train.parquet", 1024, "train"),  # two batches of 512
        "geo3k_test": write_geo3k(folder / "geo3k_test.parquet", 4, "test"),
        "gsm8k_train": train,
        "gsm8k_test": val,
        "verl": str(folder / "verl"),
        "ckpts": str(folder / "ckpts"),
    }
    for name, source, rows in [
        ("math_train", "math", train),
        ("math_test", "math", val),
        ("dapo_math_train", "dapo_math", train),
        ("aime_2024", "aime", val),
    ]:
        frame = pd.read_parquet(rows)
        frame["data_source"] = SOURCES[source]
        frame.to_parquet(folder / f"{name}.parquet")
        out[name] = str(folder / f"{name}.parquet")
    return out


def gpus_of(name: str) -> int:
    """The GPUs a node that the script names (its header says it)."""
    return int(re.search(r"(\d+) GPUs a node", (SCRIPTS / f"{name}.args").read_text())[1])


def resolve(name: str, fill: dict, capsys) -> tuple[int, str, str]:
    rc = main(["train", "--cfg", "--gpus", str(gpus_of(name)), *recorded_args(SCRIPTS / f"{name}.args", fill=fill)])
    out = capsys.readouterr()
    return rc, out.out, out.err


# What each script resolves to. colocated: verl's main_ppo (hybrid engine): synchronous, the rollout
# taking turns with the trainer on its GPUs; one-step: verl's separate rollout pool, k = 1.
# batch in prompts; mini in sequences (verl's ppo_mini_batch_size x n); kl: (use_kl_loss, coef).
COLOCATED = {"pipeline.colocate": True, "pipeline.max_staleness": 0, "rollout.engine": "vllm"}
GRPO_GSM8K = {
    **COLOCATED,
    "algorithm.adv_estimator": "grpo",
    "algorithm.use_kl_loss": True,
    "algorithm.kl_coef": 0.001,
    "algorithm.kl_estimator": "low_var_kl",
    "actor.optim.lr": 1e-6,
    "actor.optim.warmup_steps": 0,
    "data.overlong_prompts": "filter",
    "rollout.n": 5,
    "data.train_batch_size": 1024,
    "actor.mini_batch_size": 256 * 5,
    "algorithm.loss_agg_mode": "token-mean",
}
PPO = {**COLOCATED, "algorithm.adv_estimator": "gae", "algorithm.use_kl_loss": False, "actor.optim.lr": 1e-6}
RESOLVES = {
    "run_qwen2-7b": {
        **GRPO_GSM8K,
        "resources.trainer_workers": 8,
        "rollout.replicas": 8,
        "trainer.total_steps": 15 * 4,
    },
    "run_qwen3-8b": {**GRPO_GSM8K, "resources.trainer_workers": 8, "trainer.val_freq": 5},
    "run_qwen2-7b_math": {**GRPO_GSM8K, "trainer.total_steps": 15 * (2 * ROWS // 1024)},  # gsm8k + MATH files
    "run_deepseek7b_llm_seq_balance": {**GRPO_GSM8K, "actor.micro_token_budget": 24000},
    "qwen2-7b_grpo_2_h800_fsdp_vllm": {**GRPO_GSM8K, "resources.trainer_workers": 2, "rollout.replicas": 2},
    "qwen2_14b_grpo_4_h800_fsdp_vllm": {**GRPO_GSM8K, "resources.trainer_workers": 4, "trainer.total_steps": 4},
    "run_deepseek7b_llm": {**PPO, "data.train_batch_size": 1024, "trainer.val_freq": 1},
    "run_deepseek7b_llm_sp2": {**PPO, "data.train_batch_size": 1024},  # ulysses_sequence_parallel_size: a note
    "run_gemma": {**PPO, "data.train_batch_size": 512, "resources.trainer_workers": 2, "trainer.total_steps": 15 * 8},
    "run_qwen2-7b_seq_balance": {**PPO, "data.train_batch_size": 4096, "actor.micro_token_budget": 24000},
    "run_function_reward": {
        **PPO,
        "data.train_batch_size": 256,
        "trainer.total_steps": 1,
        "reward.custom_name": "compute_score",
    },
    "dapo_7b_math_fsdp2_colocate": {
        **COLOCATED,
        "resources.trainer_workers": 16,
        "rollout.replicas": 16,
        "rollout.n": 12,
        "data.train_batch_size": 512,
        "actor.mini_batch_size": 32 * 12,
        "actor.micro_token_budget": 20480,
        "algorithm.use_kl_loss": False,
        "algorithm.clip_ratio_high": 0.28,
        "algorithm.loss_agg_mode": "token-mean",
        "actor.optim.warmup_steps": 10,
        "actor.optim.weight_decay": 0.1,
        "algorithm.overlong_penalty": True,
        "algorithm.overlong_buffer_len": 4096,
        "algorithm.overlong_penalty_factor": 1.0,
        "data.overlong_prompts": "left",
        "rollout.val_top_p": 0.7,
        "trainer.total_steps": 100,
        "trainer.val_freq": 10,
        "model.override_config.max_position_embeddings": 32768,
    },
    # SGLang multi-turn: verl's tool config (rollout.agent.tool_config_path), over-sampling that cuts the
    # slowest tenth of each batch (rollout.over_sample_rate); vLLM serves in place of SGLang
    "run_qwen2.5-3b_gsm8k_multiturn": {
        **COLOCATED,
        "resources.trainer_workers": 8,
        "rollout.n": 16,
        "data.train_batch_size": 256,
        "actor.mini_batch_size": 256 * 16,
        "rollout.over_sample_rate": 0.1,
    },
    "grpo_0.6b_gsm8k_fsdp2_2_6": {
        "pipeline.colocate": False,
        "pipeline.max_staleness": 1,
        "rollout.engine": "vllm",
        "resources.trainer_workers": 6,
        "rollout.replicas": 2,
        "rollout.n": 5,
        "data.train_batch_size": 1152,
        "actor.mini_batch_size": 192 * 5,
        "algorithm.use_kl_loss": True,
        "algorithm.kl_coef": 0.001,
    },
}
# Refused as given: every problem in one message, each with its reason.
REFUSED = {
    # the DAPO recipe filters groups on the reward with the overlong penalty added; offstep's filter sees the score
    "run_dapo": ["algorithm.filter_groups.metric='seq_reward'"],
}
# Translated as written; only the tiny test model is too narrow for the script's LoRA rank 64.
TINY_MODEL_ONLY = {
    "run_qwen2_5-3b_gsm8k_grpo_lora": (
        {
            **GRPO_GSM8K,
            "resources.trainer_workers": 2,
            "data.train_batch_size": 16,
            "actor.mini_batch_size": 16 * 5,
            "actor.lora.rank": 64,
            "actor.lora.alpha": 32,
            "actor.optim.lr": 3e-6,
            "trainer.val_before_train": False,
        },
        "actor.lora.rank=64 is larger than the width",
    )
}


# Translated as written, then refused for one key only, before any worker starts; with the built-in engine
# (the fix the message names, as the run test's scaling does) it trains.
VLLM_WITH_IMAGES = {
    # verl's geo3k GRPO on Qwen2.5-VL: vLLM with image prompts is not wired (its Qwen2-VL processor needs
    # torchvision, which offstep's CPU environment lacks; docs/multimodal.md)
    "run_qwen2_5_vl-7b": {
        **COLOCATED,
        "algorithm.adv_estimator": "grpo",
        "algorithm.kl_coef": 0.01,
        "data.image_key": "images",
        "data.train_batch_size": 512,
        "rollout.n": 5,
        "actor.mini_batch_size": 128 * 5,
    },
}


def test_every_recorded_script_is_checked():
    assert sorted(p.stem for p in SCRIPTS.glob("*.args")) == sorted(
        [*RESOLVES, *REFUSED, *TINY_MODEL_ONLY, *VLLM_WITH_IMAGES]
    )
    assert len(RESOLVES) >= 13


@pytest.mark.parametrize("name", sorted(RESOLVES))
def test_verl_script_resolves_unchanged(name, fill, capsys):
    rc, out, err = resolve(name, fill, capsys)
    assert rc == 0, err
    cfg = OmegaConf.create(out)
    want = RESOLVES[name]
    assert {k: OmegaConf.select(cfg, k) for k in want} == want
    if want["pipeline.colocate"]:
        assert "verl's main_ppo (hybrid engine, synchronous) -> pipeline.colocate=true pipeline.max_staleness=0" in err


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_verl_script_refused_in_one_pass(name, fill, capsys):
    rc, out, err = resolve(name, fill, capsys)
    assert rc == 2 and not out
    reasons = REFUSED[name]
    if len(reasons) > 1:
        assert f"{len(reasons)} verl keys cannot run as given (each with its fix)" in err, err
        assert len(re.findall(r"^  - ", err, re.M)) == len(reasons), err
    for reason in reasons:
        assert reason in err, err


@pytest.mark.parametrize("name", sorted(VLLM_WITH_IMAGES))
def test_verl_vl_script_translates_and_names_the_engine_to_use(name, fill, capsys):
    rc, _, err = resolve(name, fill, capsys)
    assert rc == 2 and "rollout.engine=vllm with image prompts" in err and "rollout.engine=builtin" in err, err
    assert len(re.findall(r"^  - ", err.split("invalid configuration")[-1], re.M)) == 1, err  # the only problem
    cfg = load_config(recorded_args(SCRIPTS / f"{name}.args", fill=fill), [])
    want = VLLM_WITH_IMAGES[name]
    assert {k: OmegaConf.select(OmegaConf.structured(cfg), k) for k in want} == want


@pytest.mark.parametrize("name", sorted(TINY_MODEL_ONLY))
def test_verl_script_translates_but_the_tiny_model_is_too_narrow(name, fill, capsys):
    want, problem = TINY_MODEL_ONLY[name]
    rc, _, err = resolve(name, fill, capsys)
    assert rc == 2 and "invalid configuration" in err and problem in err, err
    assert len(re.findall(r"^  - ", err.split("invalid configuration")[-1], re.M)) == 1, err  # the only problem
    cfg = load_config(recorded_args(SCRIPTS / f"{name}.args", fill=fill), [])
    assert {k: OmegaConf.select(OmegaConf.structured(cfg), k) for k in want} == want
