"""A rollout worker: one engine replica on the rollout pool, scoring samples as they finish.

Calls to one worker run in the order they were submitted (a Ray actor runs one method at a
time), which is what orders generation and weight loads: a ``load_weights`` submitted after a
``generate`` applies once that generation is done.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from offstep.batch import GenTiming, Sample, Span
from offstep.config.choices import OPENAI_AGENT, TOOL_AGENT
from offstep.models.forward import DTYPES, sequence_logprobs
from offstep.models.loading import eos_token_ids, load_causal_lm, load_tokenizer
from offstep.models.vision import load_image_processor, pixel_inputs
from offstep.rewards.combine import Combination, SampleReward
from offstep.rollout.agents.agent_loop import AgentRunner, run_tool_rows
from offstep.rollout.agents.openai_agent import OpenAIRunner
from offstep.rollout.engines.build import build_engine
from offstep.rollout.engines.interface import RolloutEngine
from offstep.rollout.engines.plain_generation import CUT_REASONS
from offstep.rollout.engines.sleep import SleepState
from offstep.rollout.replica_spec import Request, RolloutSpec, configure_sandbox
from offstep.rollout.scoring.teacher_scoring import Teacher
from offstep.rollout.types import Completion, SamplingParams
from offstep.rollout.weight_loading import WeightLoading
from offstep.sandbox import shared
from offstep.telemetry.names import Stage
from offstep.telemetry.progress import ProgressClient


class RolloutWorker(WeightLoading):
    def __init__(
        self,
        spec: RolloutSpec,
        progress: ProgressClient | None = None,
        reward_pool: list | None = None,
        teacher_pool: list | None = None,
    ):
        """``progress``: the live display's client; ``reward_pool``, ``teacher_pool``: the workers of
        the reward model's and the teacher's own pools, where they have one."""
        e = spec.engine
        torch.set_num_threads(e.num_threads)
        if spec.sandbox is not None:  # the code rewards' and the python tool's limits, in this process
            configure_sandbox(spec.sandbox)
        self.device = torch.device("cuda" if spec.device == "cuda" else "cpu")
        tok = load_tokenizer(e.path)
        eos = eos_token_ids(tok, e.path)
        self.engine: RolloutEngine = build_engine(e, tok, eos, self.device)
        self.lora, self.ref, self.reward = e.lora, spec.ref, spec.reward
        reward_model, reward_threads = spec.reward_model, spec.reward_threads
        # reward.model: a reward model or judge beside the engine, fed as samples finish (offstep.rollout.scoring.replica_reward_model)
        self.model_reward = None
        if reward_model is not None and reward_model.kind is not None:
            from offstep.rollout.scoring.replica_reward_model import build_model_reward

            self.model_reward = build_model_reward(reward_model, self.device, reward_pool)  # pool: its workers
            reward_threads = max(reward_threads, reward_model.max_concurrency)  # the batcher gathers what waits
        self.scoring = SampleReward(
            spec.reward, self.model_reward, Combination.of(reward_model) if self.model_reward is not None else None
        )
        # distill.teacher: each finished sample's tokens scored by the teacher (offstep.rollout.scoring.teacher_scoring)
        self.teacher = (
            Teacher(spec.teacher, self.device, teacher_pool, e.num_threads) if spec.teacher is not None else None
        )
        self.ref_model = None
        # The reference, for the KL term: with LoRA, the engine's own base with the adapters off
        # (the built-in engine's model under disable_adapter, vLLM's requests that name no adapter);
        # otherwise a frozen copy of the initial policy.
        if self.ref is not None and self.lora is None:
            self.ref_model = load_causal_lm(e.path, dtype=DTYPES[self.ref.dtype]).to(self.device)
            self.ref_model.requires_grad_(False)
        self.pad_id = tok.pad_token_id
        self._sleeping = SleepState(self.engine, self.ref_model, self.device)  # rollout.sleep_during_update
        self._receiving = threading.Lock()  # fully_async, collective: one version in the buffers at a time
        self.pool = ThreadPoolExecutor(max_workers=max(1, reward_threads), thread_name_prefix="reward")
        self.progress = progress or ProgressClient()  # live progress; a no-op without a hub
        self.agent = (
            spec.agent
        )  # rollout.agent: the tool loops and OpenAI agents of their rows, started at their first call
        self._agent_runner: AgentRunner | None = None
        self._openai_runner: OpenAIRunner | None = None
        self._tok, self._eos = tok, eos
        self._path, self._image_processor = e.path, None  # loaded at the first request with images

    def generate(
        self, requests: list[Request], params: SamplingParams, seed: int, with_ref: bool = True
    ) -> tuple[list[Sample], GenTiming]:
        """Sample ``params.n`` responses per request, scoring each as soon as it finishes; with a
        reference model here (``pipeline.ref_on_rollout``), attach its log-probs too. While the
        replica streams (fully_async; a validation), on the engine's thread between two decode steps.
        A sleeping replica wakes first."""
        self._sleeping.before_generation()
        if getattr(self, "_stream", None) is not None:
            return self._stream.between_steps(lambda: self._generate(requests, params, seed, with_ref))
        return self._generate(requests, params, seed, with_ref)

    def _generate(
        self, requests: list[Request], params: SamplingParams, seed: int, with_ref: bool
    ) -> tuple[list[Sample], GenTiming]:
        if self.agent is not None and any(r.agent_name in (TOOL_AGENT, OPENAI_AGENT) for r in requests):
            return self._generate_with_tools(requests, params, seed, with_ref)
        t0 = time.time()
        version = self.engine.version
        futures: dict[int, Future] = {}
        taught: dict[int, Future] = {}  # the teacher's log-probs, asked for as each sample finishes

        def score(c: Completion) -> tuple[float, dict]:
            return self._score(requests[c.prompt_index], c.text)

        def on_finish(c: Completion) -> None:
            futures[id(c)] = self.pool.submit(score, c)
            if self.teacher is not None and with_ref:
                taught[id(c)] = self.teacher.submit(requests[c.prompt_index].prompt_ids, c.response_ids)
            self.progress.advance()

        self.progress.start(Stage.GEN, total=len(requests) * params.n, version=version)
        image_kw = {}
        if any(r.images for r in requests):  # a VL model's prompts (the built-in engine; validation refuses vLLM)
            image_kw["images"] = [self._pixels(r) for r in requests]
        completions = self.engine.generate(
            [r.prompt_ids for r in requests], params, seed, on_finish=on_finish, **image_kw
        )
        samples, pending, cut = [], {}, 0
        for c in completions:
            if c.finish_reason in CUT_REASONS:  # rollout.over_sample_rate: not scored, not trained on
                cut += 1
                continue
            fut = futures.get(id(c)) or self.pool.submit(score, c)
            try:
                value, extra = fut.result()  # a scorer's RewardError propagates to the controller
            except BaseException:
                for other in futures.values():  # don't keep scoring a batch that has failed
                    other.cancel()
                raise
            r = requests[c.prompt_index]
            samples.append(
                Sample(
                    uid=r.uid,
                    prompt_ids=list(r.prompt_ids),
                    response_ids=list(c.response_ids),
                    rollout_logprobs=list(c.logprobs),
                    finish_reason=c.finish_reason,
                    score=value,
                    version=version,
                    data_source=r.data_source,
                    text=c.text,
                    reward_extra=extra,
                )
            )
            if id(c) in taught:
                pending[id(samples[-1])] = taught[id(c)]
        if params.greedy_baseline:
            self._attach_greedy_baseline(requests, samples, params, seed)
        pics = dict(zip((r.uid for r in requests), image_kw["images"])) if image_kw else None
        return self._finish(samples, Span(t0, time.time(), version), with_ref, pending=pending, cut=cut, images=pics)

    def _pixels(self, r: Request):
        """The pixel values and grids of a request's images (``ImageInputs``), None without images."""
        if not r.images:
            return None
        if self._image_processor is None:  # a VL model's, loaded at the first request with images
            self._image_processor = load_image_processor(self._path)
        return pixel_inputs(self._image_processor, r.images)

    def _score(self, r: Request, text: str, extra_info: dict | None = None) -> tuple[float, dict]:
        """One finished sample's reward: the rule, the reward model, or both (``reward.model``)."""
        return self.scoring(
            r.data_source, text, r.ground_truth, r.extra_info if extra_info is None else extra_info, prompt=r.messages
        )

    def _finish(
        self,
        samples: list[Sample],
        gen: Span,
        with_ref: bool,
        tools: tuple[Span, ...] = (),
        earlier: tuple = (),
        pending: dict | None = None,
        cut: int = 0,
        images: dict | None = None,
    ) -> tuple[list[Sample], GenTiming]:
        """The call's report; for training (``with_ref``), the teacher's log-probs (those asked for
        as the samples finished, ``pending``) and the reference's attached first."""
        taught = ()
        if self.teacher is not None and with_ref:
            self.teacher.attach(samples, pending)
            taught = self.teacher.take_spans()
        ref = None
        if self.ref is not None and with_ref:
            self._attach_ref_logprobs(samples, images)
            ref = Span(gen.end, time.time())
        scored = self.model_reward.take_spans() if self.model_reward is not None else ()
        return samples, GenTiming(gen, ref, tools, (*earlier, *shared().log.drain()), scored, taught, cut)

    def _generate_with_tools(self, requests: list[Request], params: SamplingParams, seed: int, with_ref: bool):
        """A call with tool rows or OpenAI agents' rows: those through their agent loops
        (``offstep.rollout.agents.agent_loop``, ``openai_agent``), the others of the call as plain
        generation before them."""
        t0 = time.time()
        version = self.engine.version
        plain = [r for r in requests if r.agent_name not in (TOOL_AGENT, OPENAI_AGENT)]
        samples, plain_timing = self._generate(plain, params, seed, with_ref=False) if plain else ([], None)
        looped, spans = [], ()
        tool_rows = [r for r in requests if r.agent_name == TOOL_AGENT]
        cut = plain_timing.cut if plain_timing else 0
        if tool_rows:
            looped, spans = run_tool_rows(
                self._tool_loops(), self.engine, tool_rows, params, seed, self._score, self.pool, self.progress
            )
            cut += len(tool_rows) * params.n - len(looped)  # the loops the over-sampling cut
        agent_rows = [r for r in requests if r.agent_name == OPENAI_AGENT]
        if agent_rows:
            looped += self._openai_agents().run(self.engine, agent_rows, params, seed, self.progress)
        order = {r.uid: k for k, r in enumerate(requests)}
        samples = sorted(samples + looped, key=lambda s: order[s.uid])  # stable: a request's samples keep their order
        return self._finish(
            samples,
            Span(t0, time.time(), version),
            with_ref,
            spans,
            plain_timing.sandbox if plain_timing else (),
            cut=cut,
            images={r.uid: self._pixels(r) for r in plain if r.images},  # tool rows with images are refused
        )

    def _tool_loops(self) -> AgentRunner:
        if self._agent_runner is None:
            self._agent_runner = AgentRunner(self.agent, self._tok, self._eos)
        return self._agent_runner

    def _openai_agents(self) -> OpenAIRunner:
        if self._openai_runner is None:
            self._openai_runner = OpenAIRunner(self.agent, self._tok, self._eos)
        return self._openai_runner

    def _attach_greedy_baseline(
        self, requests: list[Request], samples: list[Sample], params: SamplingParams, seed: int
    ) -> None:
        """ReMax's baseline (Li et al. 2023, arXiv:2310.10505): one greedy response per request
        from the same weights, scored like the samples; its score and length go on every sample
        of that request."""
        greedy = dataclasses.replace(params, n=1, temperature=0.0, top_p=1.0, top_k=0, greedy_baseline=False)
        completions = self.engine.generate([r.prompt_ids for r in requests], greedy, seed)
        by_uid = {}
        for c in completions:
            r = requests[c.prompt_index]
            by_uid[r.uid] = (self._score(r, c.text)[0], len(c.response_ids))
        for s in samples:
            s.baseline_score, s.baseline_length = by_uid[s.uid]

    def _attach_ref_logprobs(self, samples: list[Sample], images: dict | None = None) -> None:
        """Reference log-probs, computed here while the trainer is busy with the previous batch.

        The same forward as the trainer's reference role (``forward_response``, same temperature
        and compute dtype), on this worker's share of the batch: of the frozen initial policy, or
        with LoRA of the engine's base (its adapters off). ``images``: the prompts' pixels by uid.
        """
        self.progress.start(Stage.REF)
        ref, sequences = self.ref, [(s.prompt_ids, s.response_ids) for s in samples]
        pics = [images.get(s.uid) for s in samples] if images else None
        if self.ref_model is not None:
            scored = sequence_logprobs(
                self.ref_model,
                sequences,
                self.pad_id,
                self.device,
                ref.temperature,
                ref.compute_dtype,
                ref.micro_batch_size,
                ref.share_prompts,
                images=pics,
            )
        else:
            scored = self.engine.base_logprobs(
                sequences, ref.temperature, ref.compute_dtype, ref.micro_batch_size, images=pics
            )
        for s, lp in zip(samples, scored):
            s.ref_logprobs = lp

    # ---------------------------------------------------------------- fully asynchronous mode
    # (pipeline.mode=fully_async, offstep.rollout.stream.replica_stream): the actor runs these on several threads
    # (max_concurrency), so a load or a take is served while the engine generates.
    def stream_start(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        partial: str,
        replay: list | None = None,
        max_kv_age: int = -1,
    ) -> None:
        """Start generating from a stream of prompt groups (``prompts``: every prompt that may come,
        for the engine's cache and shared prefix); ``replay``: a recorded schedule for it to follow
        (``offstep.rollout.engines.replica_schedule``)."""
        from offstep.rollout.stream.replica_stream import StreamServer
        from offstep.rollout.stream.stream_agents import attach_agents

        self._sleeping.before_generation()
        self._generating_again()
        openai = self.agent is not None and bool(
            self.agent.openai_path or getattr(self.agent, "env", None)
        )  # env.*: its rollouts too
        self._stream = StreamServer(
            self.engine,
            prompts,
            params,
            partial,
            self.engine.max_batch_size,
            self._score,
            self.pool,
            self._tok,
            self.progress.advance,
            share_prefix=not openai,
            replay=replay,
            max_kv_age=max_kv_age,
            teach=self.teacher.submit if self.teacher is not None else None,
            pixels=self._pixels,
        )
        if self.agent is not None:  # tool rows and OpenAI agents' rows: their loops' turns go through the stream
            attach_agents(
                self._stream, self._tool_loops(), self._openai_agents() if openai else None, self.engine, params
            )

    def stream_submit(self, groups: list) -> None:
        self._stream.submit(groups)

    def stream_take(self, wait_s: float) -> list:
        """The groups finished since the last take (reference log-probs attached when this replica
        holds the reference), waiting up to ``wait_s`` seconds for one."""
        out = self._stream.take(wait_s)
        if out and self.teacher is not None:  # asked for as each sample finished; on its own thread (or pool)
            asked = {id(s): self._stream.teaching.pop((g.uid, j), None) for g in out for j, s in enumerate(g.samples)}
            self.teacher.attach([s for g in out for s in g.samples], {k: f for k, f in asked.items() if f is not None})
            out[0].teacher_spans = self.teacher.take_spans()
        pics = {g.uid: g.images for g in out if g.images is not None}
        for g in out:  # the prompts' pixels stay here: the driver computes its own
            g.images = None
        if out and self.ref is not None:  # on the engine's thread, between two decode steps: one core
            samples = [s for g in out for s in g.samples]
            self._stream.between_steps(lambda: self._attach_ref_logprobs(samples, pics))
            self._generating_again()
        if out and self.model_reward is not None:
            out[0].reward_spans = self.model_reward.take_spans()
        if out:  # code rewards' and the python tool's runs since the last take
            out[0].sandbox = tuple(shared().log.drain())
        loops = self._stream.agents.get(TOOL_AGENT) if out else None
        if loops is not None:  # when the tool loops' tools ran, for the replica's lane of the timeline
            out[0].tool_spans = loops.take_spans()
        return out

    def _generating_again(self) -> None:
        """The live status after a reference pass or a load inside a stream: the engine generates."""
        self.progress.start(Stage.GEN, total=0, version=self.engine.version)

    def stream_schedule(self) -> list:
        """The schedule's events recorded since the last call (``offstep.rollout.engines.replica_schedule``)."""
        return self._stream.schedule.drain()

    def stream_suspend(self) -> list:
        return self._stream.suspend()

    def close(self) -> None:
        """Release what this worker holds besides its objects: the scoring threads (after the
        calls they run), the engine's cached memory, the process's sandbox log. For a worker kept for the next run
        (``tests/keep_workers.py``); a stopped one's process simply ends."""
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.engine.close()
        shared().log.drain()  # executions no step reported: the next run's first step would count them

    def sleep(self) -> Span | None:
        """Free the engine's device memory while a colocated trainer updates (``rollout.sleep_during_update``;
        ``offstep.rollout.engines.sleep``) until the next load or generation wakes it; ``None``: asleep already."""
        self.progress.start(Stage.SLEEP)
        return self._sleeping.sleep()
