"""What a rollout replica is made of (``RolloutSpec``: its engine, device, scoring, agents and
teacher), the reference log-probs it computes when asked (``RefSpec``), and the requests it
answers (``Request``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from offstep.config.choices import SINGLE_TURN
from offstep.config.schema import AgentConfig, LoRAConfig, RewardModelConfig, SandboxConfig
from offstep.rewards.registry import RewardFunction
from offstep.rollout.engines.build import BUILTIN, EngineSpec
from offstep.rollout.scoring.teacher_scoring import TeacherSpec
from offstep.sandbox import Limits, configure


@dataclass
class Request:
    """One prompt to answer ``params.n`` times; ``uid`` groups its samples."""

    uid: int
    prompt_ids: list[int]
    data_source: str
    ground_truth: object
    extra_info: dict = field(default_factory=dict)
    agent_name: str = (
        SINGLE_TURN  # tool_agent: answered by a tool loop (offstep.rollout.agents.agent_loop); openai: openai_agent
    )
    messages: list = field(
        default_factory=list
    )  # the prompt's chat messages (an OpenAI agent starts from them; a reward model reads them)
    images: tuple[bytes, ...] = ()  # its images, fitted PNGs (offstep.data.images); prompt_ids has their tokens


def configure_sandbox(s: SandboxConfig) -> None:
    """This process's sandbox from the ``sandbox`` config."""
    configure(Limits.of(s), s.concurrency, s.python)


@dataclass(frozen=True)
class RefSpec:
    """How a rollout worker computes reference log-probs (``pipeline.ref_on_rollout``)."""

    dtype: str
    compute_dtype: str
    temperature: float
    micro_batch_size: int
    share_prompts: bool = False  # actor.share_prompts: the trainer's forward, prompts computed once


@dataclass(frozen=True)
class RolloutSpec:
    """What a rollout replica is: its engine, where it runs, how it scores, and what it serves
    besides plain sampling. ``ref``: reference log-probs here (``pipeline.ref_on_rollout``);
    ``agent``: the tool loops and OpenAI agents of the rows that name one (``rollout.agent``);
    ``sandbox``: the code rewards' and the python tool's limits; ``reward_model``: a reward model or
    judge beside the rule (``reward.model``); ``teacher``: a distillation teacher (``distill``)."""

    engine: EngineSpec
    device: str
    reward: RewardFunction
    reward_threads: int = 1
    ref: RefSpec | None = None
    agent: AgentConfig | None = None
    sandbox: SandboxConfig | None = None
    reward_model: RewardModelConfig | None = None
    teacher: TeacherSpec | None = None

    @classmethod
    def local(
        cls,
        model_path: str,
        reward: RewardFunction,
        max_batch_size: int,
        *,
        dtype: str = "float32",
        num_threads: int = 1,
        reward_threads: int = 1,
        engine: str = BUILTIN,
        lora: LoRAConfig | None = None,
        scratch: str | None = None,
        **rest,
    ) -> "RolloutSpec":
        """A replica on this process's CPU (``offstep eval``, tests); ``rest``: the other fields."""
        spec = EngineSpec(engine, model_path, dtype, max_batch_size, num_threads, lora=lora, scratch=scratch)
        return cls(spec, "cpu", reward, reward_threads, **rest)
