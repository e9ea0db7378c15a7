"""verl's launch scripts run, not only resolve: each script of tests/verl_scripts/ that offstep
translates trains one step through ``offstep train``, on CPU at tiny scale. Its own keys stay as
they are, but those that size the run: the GPUs of a node become one worker each, the batch, the
lengths and the micro-batches shrink, the LoRA rank fits the tiny model, vLLM or SGLang become the
built-in engine (a vLLM engine takes seconds to start per replica; the vLLM path has tests of its
own), and the run stops after one
step without validation or checkpoints. The model is the tiny one, the data the synthetic parquet of
``test_verl_scripts.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_verl_fully_async import recorded_args
from test_verl_scripts import REFUSED, RESOLVES, SCRIPTS, TINY_MODEL_ONLY, VLLM_WITH_IMAGES, fill  # noqa: F401 (a fixture)
from verl_command_lines import GSM8K_YAML

from offstep.cli import main
from offstep.telemetry.metrics import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# The keys that size a run, at tiny scale (the script keeps every other key as it wrote it).
SCALE = {
    "data.train_batch_size": "4",
    "data.gen_batch_size": "4",
    "data.max_prompt_length": "256",
    "data.max_response_length": "8",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "4",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "2048",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "4",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "2048",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": "4",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "2048",
    "critic.ppo_micro_batch_size_per_gpu": "4",
    "critic.ppo_max_token_len_per_gpu": "2048",
    "actor_rollout_ref.rollout.n": "2",
    "actor_rollout_ref.rollout.name": "hf",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "1",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "2048",
    "reward_model.overlong_buffer.len": "4",
    "+reward_model.reward_kwargs.overlong_buffer_cfg.len": "4",
    "+reward_model.reward_kwargs.max_resp_len": "8",
    "trainer.n_gpus_per_node": "1",
    "trainer.nnodes": "1",
    "rollout.n_gpus_per_node": "1",
    "rollout.nnodes": "1",
    "trainer.device": "cpu",
    "trainer.total_epochs": "1",
    "trainer.total_training_steps": "1",
    "trainer.test_freq": "-1",
    "trainer.val_before_train": "False",
    "trainer.save_freq": "-1",
    "trainer.logger": "[console]",
}
# Scaled where a script turns them on (a LoRA rank that fits the tiny model; 0 stays 0: no LoRA).
SCALE_IF_ON = {"actor_rollout_ref.model.lora_rank": "8", "actor_rollout_ref.model.lora_alpha": "16"}
# Added where a script does not set them: one step on CPU, no validation.
ADDED = ("trainer.device", "trainer.total_training_steps", "trainer.val_before_train", "trainer.test_freq")


def scaled_args(name: str, fill: dict, out) -> list[str]:  # noqa: F811
    recorded = recorded_args(SCRIPTS / f"{name}.args")
    on = {k for a in recorded if (k := a.split("=")[0]) in SCALE_IF_ON and a.split("=", 1)[1] not in ("0", "null")}
    swap = {**SCALE, **{k: SCALE_IF_ON[k] for k in on}}
    args = recorded_args(SCRIPTS / f"{name}.args", swap=swap, fill={**fill, "ckpts": str(out)})
    keys = {a.split("=")[0].lstrip("+") for a in args}
    args += [f"{k}={SCALE[k]}" for k in ADDED if k not in keys]
    return [*args, f"trainer.default_local_dir={out}"] if "trainer.default_local_dir" not in keys else args


@pytest.mark.parametrize("name", sorted([*RESOLVES, *TINY_MODEL_ONLY, *VLLM_WITH_IMAGES]))
def test_a_translated_verl_script_trains_a_step(name, fill, tmp_path, ray_session):  # noqa: F811
    assert name not in REFUSED
    tools = Path(fill["verl"]) / "examples" / "sglang_multiturn" / "config" / "tool_config"
    tools.mkdir(parents=True, exist_ok=True)  # the multi-turn script's tool config, as verl ships it
    (tools / "gsm8k_tool_config.yaml").write_text(GSM8K_YAML)
    out = tmp_path / "run"
    assert main(["train", *scaled_args(name, fill, out)]) == 0
    steps = [m for m in read_jsonl(out / "metrics.jsonl") if m["step"] >= 1]
    assert [m["step"] for m in steps] == [1] and steps[0]["actor/grad_norm"] >= 0
