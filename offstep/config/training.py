"""The training side of the typed configuration tree (``algorithm``, ``actor``, ``critic``):
advantages, losses, KL, the optimizer and LoRA. ``schema.py`` holds the rest and the root; each
field's string is its help (``offstep train --help``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class KLControlConfig:
    """The coefficient of the KL penalty in the reward (``algorithm.use_kl_in_reward``)."""

    type: str = "fixed"
    """fixed | adaptive (Ziegler et al. 2019's proportional controller)"""
    kl_coef: float = 0.001
    """the (initial) coefficient"""
    target_kl: float = 0.1
    """adaptive: the per-token KL to steer towards"""
    horizon: int = 10000
    """adaptive: samples over which the coefficient may change by ~20%"""


@dataclass
class AlgorithmConfig:
    """Dr. GRPO = ``adv_estimator=grpo`` + ``norm_adv_by_std=false`` +
    ``loss_agg_mode=seq-mean-token-sum-norm`` (docs/algorithms.md)."""

    adv_estimator: str = "grpo"
    """how advantages are estimated (docs/algorithms.md): grpo | rloo | opo (length-weighted group baseline) | gpg | grpo_passk (only the best of a group is credited) | reinforce_plus_plus | reinforce_plus_plus_baseline | remax (greedy baseline) | gae (PPO with a critic)"""
    norm_adv_by_std: bool = True
    """grpo, grpo_passk: divide by the group's std (verl: norm_adv_by_std_in_grpo)"""
    one_response_groups: str = "zero"
    """what grpo, rloo and opo give a group of one response (rollout.n=1, odd data, dynamic sampling): zero (offstep's: no other response to compare with, so advantage 0, out of the gradient) | score (verl's: group mean 0 and std 1, so the advantage is the score, / (1 + 1e-6) for grpo with norm_adv_by_std; a verl command line gets it); score lets those estimators run with rollout.n=1"""
    gamma: float = 1.0
    """GAE, REINFORCE++: discount"""
    lam: float = 1.0
    """GAE: lambda"""
    policy_loss: str = "ppo"
    """the surrogate: ppo (clipped ratio) | gspo (sequence-level ratio) | cispo (clipped, detached importance weight; pg_loss logged as verl logs it, -sg[clip r] A log pi) | pg (importance-weighted policy gradient, no clipping)"""
    clip_ratio_low: float = 0.2
    """the ratio is clipped below at 1 - clip_ratio_low"""
    clip_ratio_high: float = 0.2
    """the ratio is clipped above at 1 + clip_ratio_high (> clip_ratio_low: DAPO's clip-higher)"""
    clip_ratio_c: Optional[float] = None
    """ppo only: dual-clip bound (> 1, e.g. 3.0); null: off"""
    loss_agg_mode: str = "token-mean"
    """how per-token losses are reduced: token-mean | token-sum (no normaliser) | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm"""
    loss_agg_horizon: int = 0
    """seq-mean-token-sum-norm's constant divisor; 0: rollout.max_new_tokens"""
    use_kl_loss: bool = True
    """KL to the reference policy as a loss term"""
    kl_coef: float = 0.001
    """the KL loss's coefficient"""
    kl_estimator: str = "low_var_kl"
    """the KL loss's estimator: k1 (kl) | abs | mse (k2) | low_var_kl (k3); k1+ | k3+ | low_var_kl+ | abs+: that value with k2's gradient (straight-through)"""
    use_kl_in_reward: bool = False
    """KL to the reference policy as a penalty in the reward"""
    kl_penalty: str = "k1"
    """the reward penalty's estimator: k1 (kl) | abs | mse (k2) | low_var_kl (k3)"""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """the coefficient of the KL penalty in the reward"""
    entropy_coeff: float = 0.0
    """entropy bonus (entropy is reported either way)"""
    correction_mode: str = "decoupled"
    """the ratio's old policy: decoupled (the trainer's log-probs, the gap to the rollout's corrected by tis, rejection_*) | bypass (the rollout's; no extra forward) | off (the trainer's, uncorrected)"""
    tis: bool = True
    """decoupled: truncated importance weights pi_old / pi_rollout, capped at tis_cap"""
    tis_cap: float = 2.0
    """decoupled: the cap of the truncated importance weights"""
    tis_level: str = "token"
    """decoupled: importance weights per token | sequence"""
    rejection_level: str = "off"
    """decoupled: reject (weight 0) tokens/responses whose ratio pi_old / pi_rollout is outside [rejection_ratio_low, rejection_ratio_high] (verl's rollout_rs *_k1 bounds the inverse, pi_rollout / pi_old; its keys are converted): off | token (verl token_k1) | sequence (product; seq_sum_k1) | geometric (geometric mean; seq_mean_k1)"""
    rejection_ratio_high: float = 2.0
    """decoupled: the upper bound of pi_old / pi_rollout before a token/response is rejected"""
    rejection_ratio_low: float = 0.0
    """decoupled: the lower bound of pi_old / pi_rollout before a token/response is rejected (0: 1 / rejection_ratio_high)"""
    rejection_kl: float = 0.0
    """decoupled: > 0: also reject responses whose mean mismatch KL (k3) exceeds it (verl seq_mean_k3)"""
    m2po_threshold: float = 0.0
    """decoupled: > 0: M2PO's second-moment mask (arXiv:2510.01161): in each mini-batch (over all ranks) drop (weight 0) the tokens with the largest (log pi_old / pi_rollout)^2 until the mean over the rest is <= this (the paper's 0.04); 0: off"""
    m2po_tokens: str = "all"
    """m2po_threshold > 0: the tokens it may drop and averages over: all (AReaL's m2_threshold) | trust_region (the paper's: advantage > 0 with ratio > 1, or advantage < 0 with ratio < 1)"""
    overlong_penalty: bool = False
    """DAPO's soft overlong punishment, added to the reward before advantages: responses longer than rollout.max_new_tokens - overlong_buffer_len lose up to overlong_penalty_factor"""
    overlong_buffer_len: int = 4
    """overlong_penalty: the tokens before rollout.max_new_tokens over which the penalty grows to overlong_penalty_factor"""
    overlong_penalty_factor: float = 1.0
    """overlong_penalty: the largest penalty"""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards are all equal and generate more"""
    dynamic_sampling_max_attempts: int = 10
    """dynamic_sampling: generations per step at most"""

    @property
    def needs_reference(self) -> bool:
        """Whether reference log-probs are needed (a KL loss or a KL penalty in the reward)."""
        return self.use_kl_loss or self.use_kl_in_reward


@dataclass
class OptimConfig:
    lr: float = 1e-6
    """AdamW learning rate"""
    weight_decay: float = 0.0
    """AdamW weight decay"""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas"""
    warmup_steps: int = 0
    """optimizer steps of linear learning-rate warm-up"""
    lr_scheduler_type: str = "constant"
    """after the warm-up: constant | cosine (verl's: decays to min_lr_ratio x lr over the run's optimizer steps)"""
    min_lr_ratio: float = 0.0
    """cosine: the learning rate the decay ends at, as a fraction of lr"""
    num_cycles: float = 0.5
    """cosine: periods over the run (0.5: one monotone decay)"""
    grad_clip: float = 1.0
    """the gradient norm is clipped to this"""


@dataclass
class LoRAConfig:
    """Low-rank adapters (Hu et al. 2021, arXiv:2106.09685) on the actor, with ``peft``: the base weights stay frozen,
    only the adapters train, travel to the rollout workers and are checkpointed; the reference is the base."""

    rank: int = 0
    """the adapters' rank r (0: full fine-tuning; e.g. 8, 16, 32)"""
    alpha: float = 0.0
    """the adapters' scale is alpha / rank (0: alpha = 2 x rank, a scale of 2)"""
    dropout: float = 0.0
    """dropout on the adapters' input during the update (never in log-prob passes or generation)"""
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    """the linear layers that get adapters, by name or name suffix (default: every attention and MLP projection of Llama/Qwen/Mistral-style models)"""

    @property
    def scale_alpha(self) -> float:
        """peft's lora_alpha: the alpha key, or 2 x rank when it is 0."""
        return self.alpha or 2.0 * self.rank


@dataclass
class ActorConfig:
    """With ``micro_token_budget > 0`` micro-batches are formed by tokens: samples sorted by length and grouped so that
    rows x (longest prompt + longest response) <= the budget, each cut to the columns its rows use (padding is not
    computed; equal to the padded setting within float32 rounding). With 0, ``micro_batch_size`` padded rows each."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """the actor's optimizer"""
    ppo_epochs: int = 1
    """passes over each batch"""
    mini_batch_size: int = 0
    """sequences per optimizer step; 0 = the whole batch"""
    micro_batch_size: int = 8
    """sequences per forward/backward (gradient accumulation)"""
    nonfinite: str = "skip"
    """an update whose loss or gradient norm is NaN/inf: skip (leave the weights and optimizer state untouched, counted in actor/skipped_steps) | stop (end the run with an error)"""
    micro_token_budget: int = -1
    """> 0: micro-batches of at most this many tokens (see ActorConfig; >= data.max_prompt_length + rollout.max_new_tokens), for the reference and critic too; -1: micro_batch_size x (data.max_prompt_length + rollout.max_new_tokens), the padded setting's memory bound with the padding cut; 0: micro_batch_size padded rows"""
    share_prompts: bool = True
    """compute each distinct prompt of a micro-batch once: its responses run as one packed sequence after it, each attending to the prompt and to itself (the log-probs of the policy and the reference, equal to separate rows to float rounding); with a token budget it counts each prompt once. false: one padded row per sample"""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """low-rank adapters instead of full fine-tuning (lora.rank > 0); on a vision-language model on its language model's layers only, the vision tower frozen with the base"""
    freeze_vision_tower: bool = False
    """a vision-language model's vision tower (``model.visual``) does not train: no gradient, no optimizer state, not in the checkpoint (it stays the model's); verl's actor.freeze_vision_tower"""


@dataclass
class CriticConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """the critic's optimizer"""
    value_clip: float = 0.5
    """the value loss clips V to V_old +- value_clip"""
    ppo_epochs: int = 1
    """passes over each batch"""
    warmup_steps: int = 0
    """critic warm-up: the first warmup_steps steps train only the critic (the actor keeps its step-0 weights); not the learning-rate warm-up (optim.warmup_steps)"""
    nonfinite: str = "skip"
    """NaN/inf value loss or gradients: skip (drop that optimizer step, counted in critic/skipped_steps) | stop (end the run with an error naming the step)"""


@dataclass
class TeacherConfig:
    """The teacher of on-policy distillation: a frozen model that scores the student's samples."""

    path: Optional[str] = None
    """a causal-LM folder (save_pretrained, safetensors) or an alias (tiny, smollm2-135m-instruct); null: no distillation. Its tokenizer must be the policy's (same vocabulary): offstep refuses others before start"""
    placement: str = "rollout"
    """where it runs: rollout (on each rollout replica, beside the engine) | pool (a pool of its own: resources.teacher_workers x resources.cpus_per_teacher_worker / gpus_per_teacher_worker; the replicas send it their finished samples)"""
    engine: str = "builtin"
    """what computes its log-probs: builtin (a transformers forward, as the trainer's) | vllm (prompt log-probs of one vLLM engine; loss_mode=k1, temperature 1)"""
    dtype: str = "float32"
    """its weights: float32 | bfloat16"""
    batch_size: int = 8
    """finished samples scored together in one forward at most"""
    timeout_s: float = 300.0
    """a batch the teacher has not scored in this many seconds fails the run, saying so (the teacher's signal is never silently dropped)"""


@dataclass
class DistillConfig:
    """On-policy distillation (docs/distillation.md): the teacher gives each sampled token its
    log-probability; the student is trained to lower the reverse KL to it."""

    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """the teacher model and where it runs"""
    loss_mode: str = "k1"
    """k1 (per-token advantage log p_teacher - log p_student on the sampled token, by the policy gradient) | forward_kl_topk (a supervised loss: the teacher's top-k log-probs at each position against the student's on the same ids; builtin teacher engine)"""
    topk: int = 8
    """loss_mode=forward_kl_topk: the teacher's most likely tokens kept per position"""
    coef: float = 1.0
    """the weight of the distillation signal (verl: distillation_loss_coef)"""
    use_task_rewards: bool = True
    """true: the task reward's advantage plus coef x the distillation signal; false: pure distillation (rewards are still computed and logged)"""
    log_prob_min_clamp: float = -10.0
    """log-probs below this are raised to it first (a token the teacher finds all but impossible)"""

    @property
    def enabled(self) -> bool:
        return self.teacher.path is not None
