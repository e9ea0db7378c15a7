"""A reward model on a rollout replica (``reward.model``): scores finished samples in batches,
beside the engine, with a concurrency limit and a timeout.

``ModelBatcher`` gathers the samples that finished while its last batch was scored (dynamic
batching: at most ``batch_size``) and scores them together on a thread of its own. A sample
waits ``timeout_s`` at most, queueing included; a timeout, a failure of the batch or an
unparseable judgement gives it no value (``ModelScore.value`` None: the fallback score, counted
by ``offstep.rewards.combine``), so a slow or broken model never hangs the run.

The scorer runs here, on the replica, or in the reward pool of its own
(``reward.model.placement=pool``: ``offstep.rollout.scoring.reward_worker``), to which ``PoolScorer``
sends each batch. Two scorers fill a batch: ``DiscriminativeScorer``, a sequence-classification reward model that
reads the policy's chat rendered with the reward model's own tokenizer and chat template (as verl
re-templates for a reward model with another tokenizer), and ``JudgeScorer``, a causal LM that
answers a prompt template through offstep's built-in engine, its text parsed into a score.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from offstep.batch import Span
from offstep.config.schema import RewardModelConfig
from offstep.models.forward import DTYPES
from offstep.models.loading import eos_token_ids, load_tokenizer
from offstep.models.reward_models import judge_folder, load_reward_model
from offstep.rewards.combine import ModelScore
from offstep.rewards.judge import parse_score, render_judge_prompt
from offstep.rollout.engines.build import EngineSpec, build_engine
from offstep.rollout.engines.interface import RolloutEngine
from offstep.rollout.types import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Item:
    """One finished sample to score: the prompt's chat messages, the response, the ground truth."""

    prompt: list
    response: str
    ground_truth: Any = None


@dataclass
class _Job:
    item: Item
    future: Future = field(default_factory=Future)
    abandoned: bool = False  # its caller timed out: not scored


def render_chat(tok, prompt: list, response: str) -> str:
    """The chat the policy produced (its prompt messages and the response as the assistant's
    turn), as text in the reward model's own chat template."""
    return tok.apply_chat_template([*prompt, {"role": "assistant", "content": response}], tokenize=False)


def question_of(prompt: list) -> str:
    """The prompt's last user message (its text parts, for a list of content parts)."""
    for m in reversed(prompt):
        if m.get("role") == "user":
            content = m.get("content", "")
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content)
    return ""


class DiscriminativeScorer:
    """A sequence-classification reward model: one forward per batch, the head's one logit."""

    def __init__(self, cfg: RewardModelConfig, device: torch.device):
        self.model, self.tok = load_reward_model(cfg.path, DTYPES[cfg.dtype], cfg.trust_remote_code)
        self.model.to(device)
        self.device, self.max_length = device, cfg.max_length

    @torch.inference_mode()
    def __call__(self, items: list[Item]) -> list[float | None]:
        texts = [render_chat(self.tok, it.prompt, it.response) for it in items]
        enc = self.tok(
            texts,
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
            add_special_tokens=False,
        ).to(self.device)
        logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
        return [float(v) for v in logits[:, 0].float().cpu()]


class JudgeScorer:
    """A generative judge: the template rendered with the judge's chat template, answered greedily
    by an engine (``reward.model.engine``: offstep's built-in one or vLLM, unless one is given), the
    text parsed into a score (None: unparseable)."""

    def __init__(self, cfg: RewardModelConfig, device: torch.device, engine: RolloutEngine | None = None):
        folder = judge_folder(cfg.path)
        self.tok = load_tokenizer(folder)
        eos = eos_token_ids(self.tok, folder)
        if engine is None:  # reward.model.engine: the built-in engine or vLLM
            spec = EngineSpec(cfg.engine, folder, cfg.dtype, cfg.batch_size, torch.get_num_threads())
            engine = build_engine(spec, self.tok, eos, device)
        self.engine, self.cfg = engine, cfg
        self.params = SamplingParams(n=1, temperature=0.0, max_new_tokens=cfg.max_new_tokens)
        self.last_texts: list[str] = []  # the judge's answers of the last batch (for logs and tests)

    def prompt_ids(self, item: Item) -> list[int]:
        text = render_judge_prompt(self.cfg.template, question_of(item.prompt), item.response, item.ground_truth)
        if self.tok.chat_template:
            ids = self.tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = self.tok(text, add_special_tokens=True)["input_ids"]
        return list(ids)[-self.cfg.max_length :]

    def __call__(self, items: list[Item]) -> list[float | None]:
        completions = self.engine.generate([self.prompt_ids(it) for it in items], self.params, seed=0)
        texts = [""] * len(items)
        for c in completions:
            texts[c.prompt_index] = c.text
        self.last_texts = texts
        return [parse_score(t, self.cfg.parser) for t in texts]


class PoolScorer:
    """A batch sent to the reward pool (``reward.model.placement=pool``): to its workers in turn,
    waiting ``timeout_s`` at most for the answer (a dead or hung worker fails the batch: its
    samples fall back, counted)."""

    def __init__(self, handles: list, timeout_s: float):
        self.handles, self.timeout_s = list(handles), timeout_s
        self._turn = itertools.count()

    def __call__(self, items: list[Item]) -> list[float | None]:
        worker = self.handles[next(self._turn) % len(self.handles)]
        return worker.score.remote(items).future().result(timeout=self.timeout_s)


class ModelBatcher:
    """Scores items in batches on threads of its own (``threads``: batches in flight at once, one
    per reward worker of a pool); ``__call__`` waits for one item's score."""

    def __init__(
        self,
        score_batch: Callable[[list[Item]], list[float | None]],
        batch_size: int,
        max_concurrency: int,
        timeout_s: float,
        threads: int = 1,
    ):
        self.score_batch, self.batch_size, self.timeout_s = score_batch, batch_size, timeout_s
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._queue: queue.Queue = queue.Queue()
        self._spans: list[Span] = []  # each batch's scoring, for the timeline
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"offstep-reward-model-{i}", daemon=True) for i in range(threads)
        ]
        for t in self._threads:
            t.start()

    def __call__(self, prompt: list, response: str, ground_truth: Any = None) -> ModelScore:
        deadline = time.monotonic() + self.timeout_s
        if not self._slots.acquire(timeout=self.timeout_s):
            return ModelScore(None, "timeout")
        try:
            job = _Job(Item(prompt, response, ground_truth))
            self._queue.put(job)
            try:
                value = job.future.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                job.abandoned = True
                return ModelScore(None, "timeout")
            except Exception as exc:  # noqa: BLE001 - the batch failed: this sample falls back, counted
                log.warning(
                    "reward model: a batch failed (%s: %s); its samples get the fallback score", type(exc).__name__, exc
                )
                return ModelScore(None, "failed")
            return ModelScore(value, "ok") if value is not None else ModelScore(None, "unparsed")
        finally:
            self._slots.release()

    def submit(self, item: Any) -> Future:
        """Queue one item for the next batch without waiting (no concurrency limit, no timeout): its
        future holds the batch's result for it, or the batch's exception (a distillation teacher's
        log-probs, ``offstep.rollout.scoring.teacher_scoring``)."""
        job = _Job(item)
        self._queue.put(job)
        return job.future

    def _run(self) -> None:
        while True:
            jobs = [self._queue.get()]
            if jobs[0] is None:
                return
            while len(jobs) < self.batch_size:
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)
                    break
                jobs.append(job)
            jobs = [j for j in jobs if not j.abandoned and j.future.set_running_or_notify_cancel()]
            if not jobs:
                continue
            t0 = time.time()
            try:
                values = self.score_batch([j.item for j in jobs])
                if len(values) != len(jobs):
                    raise RuntimeError(f"{len(values)} scores for {len(jobs)} samples")
            except Exception as exc:  # noqa: BLE001 - handed to each waiting sample
                for j in jobs:
                    j.future.set_exception(exc)
            else:
                for j, v in zip(jobs, values):
                    j.future.set_result(v)
            with self._lock:
                self._spans.append(Span(t0, time.time()))

    def take_spans(self) -> tuple[Span, ...]:
        """The batches scored since the last call."""
        with self._lock:
            spans, self._spans = tuple(self._spans), []
        return spans

    def close(self) -> None:
        for _ in self._threads:
            self._queue.put(None)


def make_scorer(cfg: RewardModelConfig, device: torch.device) -> Callable[[list[Item]], list[float | None]]:
    """The reward model of ``cfg.kind`` on ``device``: a batch of items in, their scores out."""
    return DiscriminativeScorer(cfg, device) if cfg.kind == "discriminative" else JudgeScorer(cfg, device)


def build_model_reward(cfg: RewardModelConfig, device: torch.device, pool: list | None = None) -> ModelBatcher:
    """A replica's reward model behind its batcher: here, or the reward pool's workers ``pool``."""
    if pool:
        return ModelBatcher(
            PoolScorer(pool, cfg.timeout_s), cfg.batch_size, cfg.max_concurrency, cfg.timeout_s, threads=len(pool)
        )
    return ModelBatcher(make_scorer(cfg, device), cfg.batch_size, cfg.max_concurrency, cfg.timeout_s)
