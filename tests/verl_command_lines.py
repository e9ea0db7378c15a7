"""verl command lines the tests translate, and a file verl's scripts name."""

from __future__ import annotations


def main_ppo(out, *extra: str) -> list[str]:
    """A verl main_ppo GRPO command line (examples/grpo_trainer style, small sizes): trainer GPUs
    only, no rollout pool."""
    return [
        "algorithm.adv_estimator=grpo",
        "data.train_batch_size=4",
        "data.max_prompt_length=96",
        "data.max_response_length=12",
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        "actor_rollout_ref.model.path=tiny",
        "actor_rollout_ref.actor.optim.lr=1e-4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=['console']",
        "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen_grpo",
        f"trainer.default_local_dir={out}",
        "trainer.save_freq=-1",
        "trainer.test_freq=5",
        "trainer.total_training_steps=2",
        "trainer.nnodes=1",
        "trainer.n_gpus_per_node=8",
        *extra,
    ]


# verl's examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml, as verl ships it
GSM8K_YAML = """
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, 0.0 if parsed answer is incorrect or not correctly parsed)"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "The model's answer to the GSM8K math problem, must be a digits"
          required: ["answer"]
"""
