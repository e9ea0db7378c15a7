"""Types exchanged between the controller, rollout workers and engines."""

from __future__ import annotations

from dataclasses import dataclass, field


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
