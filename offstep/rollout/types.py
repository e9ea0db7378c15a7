"""Types exchanged between the controller, rollout workers and engines, and the per-sample seed
both engines derive (``mix_seed``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


def mix_seed(seed: int, index: int) -> int:
    """SplitMix64 of (seed, index): well-spread 63-bit seeds for per-sample generators (sample
    ``index``'s own random stream in both engines: ``offstep.rollout.engines.sampling`` and vLLM's per-request seed)."""
    mask = (1 << 64) - 1
    z = (int(seed) * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SamplingParams:
    """How one generation call samples.

    ``top_k = 0`` and ``top_p = 1.0`` disable those filters. ``temperature = 0`` is greedy decoding
    (log-probs are then those of the untempered distribution). ``stop`` strings end a sample when
    its decoded text contains one; the stop string stays in the response (as verl's vLLM setting
    ``include_stop_str_in_output``). ``greedy_baseline`` is read by the rollout worker, not the
    engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    # ReMax: also decode one greedy response per prompt (same weights) and score it; its score
    # becomes every sample's ``baseline_score``. Not part of the returned samples.
    greedy_baseline: bool = False
    # verl's over-sampling (``rollout.over_sample_rate``): plain generation stops once this share of
    # a call's samples is left unfinished; the rest are cut (``offstep.rollout.engines.plain_generation``).
    over_sample_rate: float = 0.0


@dataclass
class Completion:
    """One sampled response to one prompt.

    ``logprobs[i]`` is the log-probability of ``response_ids[i]`` under the distribution it was
    sampled from (temperature, top-k and top-p applied). ``finish_reason`` is ``"stop"`` (EOS or a
    stop string) or ``"length"`` (``max_new_tokens`` reached).
    """

    prompt_index: int
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str = ""
    extra: dict = field(default_factory=dict)
    versions: list[int] = field(default_factory=list)  # the weight version that sampled each token


@dataclass(frozen=True)
class TurnRequest:
    """One sequence for an engine to continue, as an engine's ``serve`` takes them from a feed:
    ``prompt_ids`` are all its tokens so far (a prompt; in an agent loop the prompt and the turns
    before, token for token), to be continued by at most ``max_new_tokens`` tokens.

    ``index`` names the request in ``on_finish(index, completion)``. ``stream`` picks the random
    stream its tokens are sampled with (``offstep.rollout.engines.sampling``): a sample's index in plain
    generation, so a sample's first turn draws exactly what it draws in ``generate``; ``seed`` and
    ``offset`` let a request continue a stream begun elsewhere (a suspended sample, resumed). Requests of
    one ``group`` taken together have the same ``prompt_ids`` (the samples of one prompt) and are
    prefilled once; ``group`` is the completion's ``prompt_index``.
    """

    index: int
    prompt_ids: list[int]
    stream: int
    max_new_tokens: int
    group: int
    seed: int | None = None  # the seed of its random stream; None: the serve call's
    offset: int = 0  # tokens of its stream already sampled (a continued sample): its uniforms start there
    stop: tuple[str, ...] | None = None  # its own stop strings (an agent's turn); None: the serve call's
    images: Any = None  # its prompt's images (offstep.models.vision.ImageInputs; the built-in engine's HF runner)


class TurnFeed(Protocol):
    """Requests that arrive while an engine generates (``serve``). ``prompts`` are the first
    requests' prompts: no request is longer than the longest of them plus the call's
    ``max_new_tokens`` (its prompt and new tokens together), and a prefix all of them share is
    shared by every request. At most ``concurrency`` requests are in flight at once (the engine
    sizes its batch for that many). A feed whose requests need not share the prompts' prefix (an
    OpenAI endpoint's calls render their own chat) sets ``share_prefix = False``."""

    prompts: list[list[int]]
    concurrency: int

    def take(self, limit: int, block: bool) -> list[TurnRequest] | None:
        """Up to ``limit`` requests to start now; ``block``: wait until there is at least one.
        ``None``: no request will come any more."""
        ...


def check_request(prompts: list[list[int]], params: SamplingParams, vocab_size: int) -> None:
    """The arguments of an engine's ``generate``, checked the same way by every engine."""
    if params.n < 1:
        raise ValueError(f"SamplingParams.n={params.n} must be >= 1")
    if params.temperature < 0:
        raise ValueError(f"SamplingParams.temperature={params.temperature} must be >= 0 (0: greedy)")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"SamplingParams.top_p={params.top_p} must be in (0, 1]")
    if params.top_k < 0:
        raise ValueError(f"SamplingParams.top_k={params.top_k} must be >= 0 (0: disabled)")
    if params.max_new_tokens < 0:
        raise ValueError(f"SamplingParams.max_new_tokens={params.max_new_tokens} must be >= 0")
    if isinstance(params.stop, str):
        raise ValueError("SamplingParams.stop must be a tuple of strings, not a string")
    if any(not s for s in params.stop):
        raise ValueError("SamplingParams.stop contains an empty string")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; a prompt needs at least one token")
        lo, hi = min(p), max(p)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"prompt {i} has token id {bad} outside the model's vocabulary [0, {vocab_size})")
