"""A distillation teacher for the rollout replicas (``distill.teacher``): it gives each finished
sample's response tokens their log-probabilities under the teacher (and with
``distill.loss_mode=forward_kl_topk`` its top-k at each position), off the trainer's critical path.

The replica hands a sample to ``Teacher.submit`` as soon as it finishes; a batcher thread
(``replica_reward_model.ModelBatcher``, as the reward model's) gathers what has finished and scores
it in one forward, here (``placement=rollout``) or on a worker of the teacher pool
(``placement=pool``: ``TeacherWorker``, sent through ``PoolScorer``). ``Teacher.attach`` waits for
every sample of a generation call or a stream take and writes the fields onto them. The teacher's
weights never change, so it is never synced. A teacher that fails or does not answer within
``distill.teacher.timeout_s`` fails the run with a ``TeacherError`` saying so: a sample is never
trained without its teacher signal.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Sequence

import torch

from offstep.batch import Sample
from offstep.errors import OffstepError
from offstep.models.forward import DTYPES, sequence_logprobs, sequence_topk
from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer
from offstep.rollout.engines.build import VLLM, EngineSpec, build_engine
from offstep.rollout.scoring.replica_reward_model import ModelBatcher, PoolScorer


class TeacherError(OffstepError):
    """The teacher failed or did not answer in time; the run stops rather than train without it."""


@dataclass(frozen=True)
class TeacherSpec:
    """What a replica or a teacher-pool worker needs to build the teacher (from ``distill``)."""

    path: str  # the resolved folder
    dtype: str
    engine: str  # builtin | vllm
    temperature: float  # the rollout's: the student's log-probs are tempered by it too
    compute_dtype: str
    batch_size: int
    topk: int  # 0: the sampled tokens' log-probs only
    timeout_s: float

    @classmethod
    def of(cls, cfg, path: str) -> "TeacherSpec":
        d = cfg.distill
        return cls(
            path,
            d.teacher.dtype,
            d.teacher.engine,
            cfg.rollout.temperature,
            cfg.model.compute_dtype,
            d.teacher.batch_size,
            d.topk if d.loss_mode == "forward_kl_topk" else 0,
            d.teacher.timeout_s,
        )


@dataclass
class TeacherTokens:
    """The teacher's view of one response: each token's log-prob, and optionally its top-k."""

    logprobs: list[float]
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None


class TeacherModel:
    """The teacher itself: a batch of ``(prompt_ids, response_ids)`` in, their ``TeacherTokens``
    out. The built-in path is the trainer's forward (``models.forward``) on the teacher's weights,
    at the rollout's temperature; vLLM's is its prompt log-probs (untempered: the config check asks
    for rollout.temperature=1)."""

    def __init__(self, spec: TeacherSpec, device: torch.device, num_threads: int = 1):
        self.spec, self.device = spec, device
        tok = load_tokenizer(spec.path)
        self.pad_id = tok.pad_token_id
        self.model = self.engine = None
        if spec.engine == VLLM:  # its prompt log-probs; the built-in path is the trainer's forward, not an engine
            engine = EngineSpec(VLLM, spec.path, spec.dtype, spec.batch_size, num_threads)
            self.engine = build_engine(engine, tok, eos_token_ids(tok, spec.path), device)
        else:
            self.model = load_causal_lm(spec.path, dtype=DTYPES[spec.dtype]).to(device).requires_grad_(False)

    def __call__(self, sequences: Sequence[tuple[list[int], list[int]]]) -> list[TeacherTokens]:
        s = self.spec
        if self.engine is not None:
            return [TeacherTokens(lp) for lp in self.engine.base_logprobs(list(sequences), s.temperature)]
        if s.topk:
            return [
                TeacherTokens(*t)
                for t in sequence_topk(
                    self.model,
                    sequences,
                    self.pad_id,
                    self.device,
                    s.temperature,
                    s.topk,
                    s.compute_dtype,
                    s.batch_size,
                )
            ]
        return [
            TeacherTokens(lp)
            for lp in sequence_logprobs(
                self.model, sequences, self.pad_id, self.device, s.temperature, s.compute_dtype, s.batch_size
            )
        ]


class TeacherWorker:
    """A worker of the teacher pool (``distill.teacher.placement=pool``): one teacher, scoring the
    batches the replicas send it."""

    def __init__(self, spec: TeacherSpec, device: str, num_threads: int):
        torch.set_num_threads(num_threads)
        self.teacher = TeacherModel(spec, torch.device("cuda" if device == "cuda" else "cpu"), num_threads)

    def score(self, sequences: list[tuple[list[int], list[int]]]) -> list[TeacherTokens]:
        return self.teacher(sequences)


class Teacher:
    """A replica's teacher: here, or the teacher pool's workers ``pool``, behind a batcher."""

    def __init__(self, spec: TeacherSpec, device: torch.device, pool: list | None = None, num_threads: int = 1):
        score = PoolScorer(pool, spec.timeout_s) if pool else TeacherModel(spec, device, num_threads)
        self.spec = spec
        self.batcher = ModelBatcher(
            score, spec.batch_size, max_concurrency=1, timeout_s=spec.timeout_s, threads=len(pool) if pool else 1
        )

    def submit(self, prompt_ids: Sequence[int], response_ids: Sequence[int]) -> Future:
        """Queue a finished sample's tokens for the teacher's next batch, without waiting."""
        return self.batcher.submit((list(prompt_ids), list(response_ids)))

    def attach(self, samples: list[Sample], pending: dict[int, Future] | None = None) -> None:
        """Write the teacher's log-probs (and top-k) onto ``samples``, waiting for the ones submitted
        earlier (``pending``, by ``id(sample)``) and submitting the others now."""
        pending = pending or {}
        futures = [pending.get(id(s)) or self.submit(s.prompt_ids, s.response_ids) for s in samples]
        deadline = time.monotonic() + self.spec.timeout_s
        for s, fut in zip(samples, futures):
            try:
                t: TeacherTokens = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise TeacherError(
                    f"distill.teacher ({self.spec.path}) gave no log-probs within "
                    f"distill.teacher.timeout_s={self.spec.timeout_s} s; raise the timeout, lower "
                    f"distill.teacher.batch_size, or give the teacher more cores "
                    f"(resources.cpus_per_teacher_worker with placement=pool)"
                ) from None
            except Exception as e:  # noqa: BLE001 - named and re-raised as the run's error
                raise TeacherError(f"distill.teacher ({self.spec.path}) failed: {type(e).__name__}: {e}") from e
            if len(t.logprobs) != len(s.response_ids):
                raise TeacherError(
                    f"distill.teacher gave {len(t.logprobs)} log-probs for a response of {len(s.response_ids)} tokens"
                )
            s.teacher_logprobs, s.teacher_topk_ids, s.teacher_topk_logprobs = t.logprobs, t.topk_ids, t.topk_logprobs

    def take_spans(self) -> tuple:
        """The teacher's batches since the last call, for the timeline."""
        return self.batcher.take_spans()

    def close(self) -> None:
        self.batcher.close()
